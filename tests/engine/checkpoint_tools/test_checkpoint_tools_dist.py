"""``smp2ds checkpoint`` on checkpoints real multi-rank runs wrote (tp 2 x pp 2, tp 2 x sdp 2, tp 2, ZeRO-1 rdp 2).

Proofs: the consolidated state dict equals the model's full ``state_dict()`` gathered at training
time bit for bit; the exported Hugging Face directory loads with ``AutoModelForCausalLM`` and its
logits equal a plain Hugging Face model holding that state dict (and, without pipelining, the
trained smp2ds model's own logits); ``inspect`` reports the layout and calls the folder complete.
``reshard`` output resumes at the new layout like one uninterrupted single process. The training
runs happen once per module (two 4-rank launches and two 2-rank launches). Optimizer state sharded over
data-parallel ranks (ZeRO-3 of sharded data parallelism, ZeRO-1 of ``shard_optimizer_state``) is
consolidated and re-cut like the unsharded kind, with the same proofs.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from smp2ds.cli import main
from tests._dist import run_ranks
from tests.engine.workers import checkpoint_tools_workers as cw
from tests.engine.workers import tp_sdp_workers as sdpw
from tests.engine.workers import tp_workers as tw

PP_CONFIG = {"ddp": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2}
PP_MODELS = ("gpt2", "llama", "gpt_neox")
SDP_MODELS = ("gpt2", "gpt2_replaced")
TP_CONFIG = {"ddp": True, "tensor_parallel_degree": 2}
GROUPED = "gpt2_replaced_groups"
"""SMP's GPT-2 script at tp 2: the distributed transformer, AdamW over two groups split by weight decay."""
GROUPED_NEOX = "neox_replaced_groups"
"""The same for GPT-NeoX (SMP's GPT-NeoX example replaces it too)."""
ZERO1_CONFIG = {"ddp": True, "shard_optimizer_state": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{layout: (root folder, {model: rank 0's results})}: both runs, trained and saved once."""
    out = {}
    for layout, world, config, models in (("pp2-tp2", 4, PP_CONFIG, PP_MODELS), ("tp2-sdp2", 4, sdpw.CONFIG, SDP_MODELS),
                                          ("tp2", 2, TP_CONFIG, ("gpt2", GROUPED, GROUPED_NEOX)),
                                          ("zero1-rdp2", 2, ZERO1_CONFIG, ("gpt2",))):
        root = str(tmp_path_factory.mktemp(layout))
        phases = [{"name": m, "model": m.removesuffix("_groups"), "seed": 40 + i, "groups": m.endswith("_groups")}
                  for i, m in enumerate(models)]
        per_rank = run_ranks(cw.train_and_save, world, config, phases, root)
        rank0 = [{k: _torch(v) for k, v in r.items()} for r in per_rank[0]]
        out[layout] = (root, dict(zip(models, rank0)))
    return out


def _torch(value: object) -> object:
    """The workers send numpy arrays (fp32 here): back to tensors, dicts of them likewise."""
    if isinstance(value, dict):
        return {k: torch.from_numpy(v) for k, v in value.items()}
    return torch.from_numpy(value)


CASES = [("pp2-tp2", m) for m in PP_MODELS] + [("tp2-sdp2", m) for m in SDP_MODELS]


def _hf_reference(model: str, seed: int) -> torch.nn.Module:
    return cw.hf_of(model, seed)


@pytest.mark.slow
@pytest.mark.parametrize("layout,model", CASES)
def test_consolidated_state_dict_is_bit_identical_to_the_gathered_one(runs, tmp_path, layout, model):
    from safetensors.torch import load_file

    root, results = runs[layout]
    out = str(tmp_path / "full.safetensors")
    assert main(["checkpoint", "consolidate", os.path.join(root, model), "--out", out, "--quiet"]) == 0
    got, want = load_file(out), results[model]["state_dict"]
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.slow
def test_consolidate_pt_format_and_an_older_tag(runs, tmp_path):
    root, results = runs["pp2-tp2"]
    out = str(tmp_path / "full.pt")
    assert main(["checkpoint", "consolidate", os.path.join(root, "gpt2"), "--out", out, "--format", "pt",
                 "--quiet"]) == 0
    got = torch.load(out, weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in results["gpt2"]["state_dict"].items())
    older = str(tmp_path / "step1.safetensors")
    assert main(["checkpoint", "consolidate", os.path.join(root, "gpt2"), "--tag", "step1", "--out", older,
                 "--quiet"]) == 0
    from safetensors.torch import load_file

    step1 = load_file(older)
    assert sorted(step1) == sorted(got)
    assert any(not torch.equal(step1[k], got[k]) for k in got)  # one more step moved the weights


@pytest.mark.slow
@pytest.mark.parametrize("layout,model", CASES)
def test_inspect_reports_the_layout_and_a_complete_folder(runs, capsys, layout, model):
    root, results = runs[layout]
    assert main(["checkpoint", "inspect", os.path.join(root, model), "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    sd = results[model]["state_dict"]
    assert rep["complete"] and rep["problems"] == []
    assert rep["tag"] == "step2" and rep["newest"] == "step2_partial"
    assert rep["checkpoints"] == ["step1_partial", "step2_partial"]
    pp = 2 if layout == "pp2-tp2" else 1
    assert rep["layout"]["pipeline_parallel_degree"] == pp and rep["layout"]["tensor_parallel_degree"] == 2
    assert rep["layout"]["world_size"] == 4
    assert rep["layout"]["sharded_data_parallel_degree"] == (2 if layout == "tp2-sdp2" else 1)
    assert len(rep["model_files"]) == pp * 2
    assert rep["parameters"] == sum(v.numel() for v in sd.values()) and rep["tensors"] == len(sd)
    assert rep["dtypes"] == {"float32": len(sd)}
    assert rep["optimizer_state"] and rep["user_content"] and rep["manifest"]
    assert main(["checkpoint", "inspect", os.path.join(root, model)]) == 0
    text = capsys.readouterr().out
    assert f"pp {pp} x tp 2" in text and "complete" in text


@pytest.mark.slow
@pytest.mark.parametrize("layout,model", CASES)
def test_exported_hf_directory_gives_the_trained_models_logits(runs, tmp_path, layout, model):
    import transformers as tf

    root, results = runs[layout]
    seed = 40 + (PP_MODELS if layout == "pp2-tp2" else SDP_MODELS).index(model)
    config = tmp_path / "config.json"
    reference = _hf_reference(model, seed)
    reference.config.to_json_file(str(config))
    out = tmp_path / "hf"
    assert main(["checkpoint", "export", os.path.join(root, model), "--to", "hf", str(out), "--config",
                 str(config), "--quiet"]) == 0
    assert (out / "config.json").is_file() and any(f.endswith(".safetensors") for f in os.listdir(out))
    exported = tf.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    with torch.no_grad():
        got = exported(input_ids=cw.PROBE, use_cache=False).logits
    if model != "gpt2_replaced":  # names are Hugging Face's already: the gathered state dict loads as it is
        reference.load_state_dict(results[model]["state_dict"], strict=True)
        with torch.no_grad():
            assert torch.equal(got, reference.eval()(input_ids=cw.PROBE, use_cache=False).logits)
    if "logits" in results[model]:  # no pipelining: the smp2ds model itself ran the probe
        torch.testing.assert_close(got, results[model]["logits"], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_export_sizes_the_config_from_the_shapes(runs, tmp_path):
    import transformers as tf

    root, results = runs["pp2-tp2"]
    out = tmp_path / "hf"
    assert main(["checkpoint", "export", os.path.join(root, "llama"), "--to", "hf", str(out), "--model-type", "llama",
                 "--num-attention-heads", "4", "--quiet"]) == 0
    exported = tf.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    reference = tw.hf_model("llama", 41)
    reference.load_state_dict(results["llama"]["state_dict"], strict=True)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=cw.PROBE).logits, reference.eval()(input_ids=cw.PROBE).logits,
                                   rtol=0, atol=0)


@pytest.mark.slow
def test_files_of_two_saves_mixed_in_one_folder_are_named(runs, tmp_path, capsys):
    import shutil

    root, results = runs["pp2-tp2"]
    mixed = tmp_path / "gpt2"
    shutil.copytree(os.path.join(root, "gpt2"), mixed)
    shutil.copyfile(mixed / "step1_partial" / "model_1_0.pt", mixed / "step2_partial" / "model_1_0.pt")
    assert main(["checkpoint", "inspect", str(mixed), "--format", "json"]) == 1
    captured = capsys.readouterr()
    rep = json.loads(captured.out)
    assert [os.path.basename(p["file"]) for p in rep["problems"]] == ["model_1_0.pt"], rep["problems"]
    assert rep["parameters"] < sum(v.numel() for v in results["gpt2"]["state_dict"].values())  # stage 1 unread
    assert "tags mixed" in rep["problems"][0]["message"] and "Traceback" not in captured.err
    assert main(["checkpoint", "consolidate", str(mixed), "--out", str(tmp_path / "x.safetensors"), "--quiet"]) == 1
    assert "model_1_0.pt" in capsys.readouterr().err
    assert main(["checkpoint", "inspect", str(mixed), "--tag", "step1", "--format", "json"]) == 0  # untouched


def _reference_adamw_state(model: str, seed: int, dp: int, b: int = 2, steps: int = 2,
                           clip: float | None = None, groups: bool = False) -> tuple[dict, dict]:
    """Single-process AdamW on the union of the data-parallel ranks' rows (the workers' data and
    loss: the mean of the ranks' mean losses), gradients clipped to norm ``clip`` when given (as
    ``sdp_gradient_clipping``), over the weight-decay groups with ``groups``: (optimizer state by parameter
    name, weights)."""
    net, opt = _reference_net(model, seed, groups)
    _train_reference(net, opt, range(steps), dp, b, clip)
    names = {id(p): n for n, p in net.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}, net.state_dict()


def _reference_net(model: str, seed: int, groups: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = _hf_reference(model, seed)
    return net, tw.make_optimizer("adamw", cw.decay_groups(net.named_parameters()) if groups else net.parameters())


def _train_reference(net: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, dp: int, b: int = 2,
                     clip: float | None = None) -> list[float]:
    """The workers' steps in one process; returns each step's loss (the mean of the ranks' mean losses)."""
    out = []
    vocab = min(tw.VOCAB, cw.trw.VOCAB)
    for step in steps:
        ids = tw.global_ids(step, dp * b) % vocab
        losses = [net(input_ids=ids[r * b:(r + 1) * b], labels=ids[r * b:(r + 1) * b], use_cache=False).loss
                  for r in range(dp)]
        loss = torch.stack(losses).mean()
        loss.backward()
        out.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return out


HF_NAMED = [(GROUPED, "gpt2", "dcp"), (GROUPED, "gpt2", "deepspeed-universal"), (GROUPED_NEOX, "gpt_neox", "dcp"),
            (GROUPED_NEOX, "gpt_neox", "deepspeed-universal")]


@pytest.mark.slow
@pytest.mark.parametrize("name,family,to", HF_NAMED, ids=[f"{f}-{t}" for _, f, t in HF_NAMED])
def test_distributed_transformer_exports_leave_in_hugging_face_names_weights_and_moments(runs, tmp_path, name,
                                                                                          family, to):
    """SMP's GPT-2 script at tp 2 (the distributed transformer, AdamW over two groups split by weight decay):
    the DCP and universal exports hold Hugging Face's names, and the weights, both Adam moments and both groups
    equal single-process Hugging Face AdamW on the same rows; the DCP export loads with DCP's own loader into
    a plain Hugging Face GPT-2 and trains on like the uninterrupted reference. ``--names smp`` keeps SMP's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    root, _ = runs["tp2"]
    kind = name.removesuffix("_groups")
    ckpt, out = os.path.join(root, name), str(tmp_path / "export")
    flags = ["--model-type", family, "--num-attention-heads", "4"]
    assert main(["checkpoint", "export", ckpt, "--to", to, out, *flags, "--quiet"]) == 0
    seed = 40 + (1 if name == GROUPED else 2)  # the phases of the tp2 run
    want, weights = _reference_adamw_state(kind, seed, dp=2, groups=True)  # tp ranks read their own rows
    if to == "dcp":
        dcp_to_torch_save(out, str(tmp_path / "flat.pt"))
        got = torch.load(str(tmp_path / "flat.pt"), weights_only=False)
        model, optim = got["model"], got["optim"]
    else:
        tag = open(os.path.join(out, "latest_universal")).read()
        zero = os.path.join(out, tag, "zero")
        model = {n: torch.load(os.path.join(zero, n, "fp32.pt"), weights_only=False)["param"]
                 for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n))}
        optim = {"state": {n: {m: torch.load(os.path.join(zero, n, f"{m}.pt"), weights_only=False)["param"]
                               for m in ("exp_avg", "exp_avg_sq")}
                           for n in model if os.path.isfile(os.path.join(zero, n, "exp_avg.pt"))}}
    assert set(model) >= set(weights) - {"lm_head.weight"} and not any(".seq_layers." in k for k in model)
    for key, value in weights.items():
        if key in model:
            tpd._close(model[key].float(), value, f"{to} {key}", tpd.ADAMW_ATOL)
    assert sorted(optim["state"]) == sorted(want)  # the tied head once, under the embedding's name
    for name, state in want.items():
        for moment in ("exp_avg", "exp_avg_sq"):
            tpd._close(optim["state"][name][moment], state[moment], f"{to} {name} {moment}", 1e-6)
    if to != "dcp":
        return
    net, opt = _reference_net(kind, seed, groups=True)
    expected_groups = [sorted(n for n, p in net.named_parameters() if any(p is q for q in g["params"]))
                       for g in opt.param_groups]
    assert [sorted(g["params"]) for g in optim["param_groups"]] == expected_groups
    assert [g["weight_decay"] for g in optim["param_groups"]] == [0.01, 0.0]
    assert _continue_from_dcp(out, kind, seed) == pytest.approx(_uninterrupted(kind, seed), abs=1e-5)
    smp_out = str(tmp_path / "smp-names")
    assert main(["checkpoint", "export", ckpt, "--to", to, smp_out, "--names", "smp", "--quiet"]) == 0
    dcp_to_torch_save(smp_out, str(tmp_path / "smp.pt"))
    assert any(".seq_layers." in k for k in torch.load(str(tmp_path / "smp.pt"), weights_only=False)["model"])


def _continue_from_dcp(path: str, model: str, seed: int) -> list[float]:
    """A fresh Hugging Face GPT-2 (other weights) and AdamW over the same groups load the DCP export with DCP's
    own loader (``get_state_dict`` / ``dcp.load`` / ``set_state_dict``, one process) and train steps 2 and 3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    net, opt = _reference_net(model, seed + 500, groups=True)
    msd, osd = get_state_dict(net, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _train_reference(net, opt, range(2, 4), dp=2)


def _uninterrupted(model: str, seed: int) -> list[float]:
    net, opt = _reference_net(model, seed, groups=True)
    return _train_reference(net, opt, range(4), dp=2)[2:]


@pytest.mark.slow
@pytest.mark.parametrize("model", PP_MODELS)
def test_consolidated_optimizer_state_equals_single_process_adamw(runs, tmp_path, capsys, model):
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    root, results = runs["pp2-tp2"]
    out = str(tmp_path / "full.safetensors")
    assert main(["checkpoint", "consolidate", os.path.join(root, model), "--out", out, "--with-optimizer"]) == 0
    assert "optimizer state of" in capsys.readouterr().err
    got = torch.load(str(tmp_path / "full.optimizer.pt"), weights_only=True)
    want, weights = _reference_adamw_state(model, 40 + PP_MODELS.index(model), dp=2)
    for key, value in weights.items():  # the run trained like the reference: the moments can be compared
        tpd._close(results[model]["state_dict"][key], value, key, tpd.ADAMW_ATOL)
    assert sorted(got["state"]) == sorted(want)  # GPT-2's tied head: its state once, under the embedding's name
    assert [sorted(g["params"]) for g in got["param_groups"]] == [sorted(want)]
    assert got["param_groups"][0]["lr"] == 0.01 and got["param_groups"][0]["weight_decay"] == 0.01
    for name, state in want.items():
        assert int(got["state"][name]["step"]) == int(state["step"]) == 2
        for moment in ("exp_avg", "exp_avg_sq"):
            tpd._close(got["state"][name][moment], state[moment], f"{name} {moment}", 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout,clip", [("tp2-sdp2", sdpw.CLIP), ("zero1-rdp2", None)])
def test_consolidated_sharded_optimizer_state_equals_single_process_adamw(runs, tmp_path, layout, clip):
    """tp 2 x sdp 2 (each rank's ZeRO-3 flat partition cut back into per-parameter moments, joined
    over tp) and ZeRO-1 over rdp 2 (one flat buffer cut across parameters): the moments equal
    single-process AdamW (clipped like sdp_gradient_clipping) on the same rows."""
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    root, results = runs[layout]
    out = str(tmp_path / "full.safetensors")
    assert main(["checkpoint", "consolidate", os.path.join(root, "gpt2"), "--out", out, "--with-optimizer",
                 "--quiet"]) == 0
    got = torch.load(str(tmp_path / "full.optimizer.pt"), weights_only=True)
    want, weights = _reference_adamw_state("gpt2", 40, dp=2, clip=clip)
    for key, value in weights.items():
        tpd._close(results["gpt2"]["state_dict"][key], value, key, tpd.ADAMW_ATOL)
    assert sorted(got["state"]) == sorted(want) and [sorted(g["params"]) for g in got["param_groups"]] == [sorted(want)]
    assert got["param_groups"][0]["lr"] == 0.01
    for name, state in want.items():
        assert int(got["state"][name]["step"]) == 2
        for moment in ("exp_avg", "exp_avg_sq"):
            tpd._close(got["state"][name][moment], state[moment], f"{name} {moment}", 1e-6)


@pytest.mark.slow
def test_consolidated_sdp_optimizer_state_of_the_distributed_transformer(runs, tmp_path):
    """SMP's distributed transformer under tp 2 x sdp 2: other names and parameter order, same cut (the
    master weights cut out of the partitions must equal the model file's, or consolidation refuses)."""
    root, results = runs["tp2-sdp2"]
    out = str(tmp_path / "replaced.safetensors")
    assert main(["checkpoint", "consolidate", os.path.join(root, "gpt2_replaced"), "--out", out,
                 "--with-optimizer", "--quiet"]) == 0
    replaced = torch.load(str(tmp_path / "replaced.optimizer.pt"), weights_only=True)
    sd = results["gpt2_replaced"]["state_dict"]
    assert set(replaced["state"]) <= set(sd) and len(replaced["state"]) >= len(sd) - 1  # a tied head once
    for name, state in replaced["state"].items():
        assert int(state["step"]) == 2 and state["exp_avg"].shape == sd[name].shape, name


def _rewrite_meta(root: str, tmp_path: object, **meta: object) -> str:
    """A copy of the checkpoint whose optimizer files claim ``meta`` (a ZeRO-1 or 16-bit save's
    marker), to reach the refusals without another training run."""
    import shutil

    from smp2ds.engine.checkpoint_tools.reading import load_weights

    copy = os.path.join(str(tmp_path), "claimed")
    shutil.copytree(root, copy)
    part = os.path.join(copy, "step2_partial")
    os.remove(os.path.join(part, "smp2ds_manifest.json"))  # the rewritten files would fail its digests
    for name in os.listdir(part):
        if name.startswith("optimizer_states_"):
            obj = load_weights(os.path.join(part, name), mmap=False, deepspeed_state=True)
            obj["smp2ds"].update(meta)
            torch.save(obj, os.path.join(part, name))
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("layout,meta,message", [
    ("tp2-sdp2", {"zero_stage": 1}, "ZeRO stage 1 (shard_optimizer_state) with precision 'fp32' where the "
                                    "checkpoint's configuration implies stage 3"),
    ("zero1-rdp2", {"precision": "bf16"}, "precision 'bf16'")], ids=["stage1-marker-in-sdp", "bf16-zero1"])
def test_mismatched_and_16_bit_optimizer_state_are_refused_before_anything_is_written(runs, tmp_path, capsys, layout,
                                                                                      meta, message):
    claimed = _rewrite_meta(os.path.join(runs[layout][0], "gpt2"), tmp_path, **meta)
    out = tmp_path / "out"
    assert main(["checkpoint", "consolidate", claimed, "--out", str(out / "full.safetensors"),
                 "--with-optimizer"]) == 2
    err = capsys.readouterr().err
    assert "optimizer_states_0_0_0.pt" in err and message in err and "allowed: fp32 optimizer state" in err, err
    assert main(["checkpoint", "reshard", claimed, "--out", str(out), "--tp", "1", "--pp", "1", "--world", "4"]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


RESHARDS = {
    # id: (trained layout, reshard flags, the new layout's config, per-rank rows b, {inspect's layout})
    "tp2xpp2-to-tp1xpp2xrdp2": ("pp2-tp2", ["--tp", "1", "--pp", "2", "--world", "4"],
                                {**PP_CONFIG, "tensor_parallel_degree": 1}, 2,
                                {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 1, "rdp": 2}),
    "tp2-to-tp4": ("tp2", ["--tp", "4", "--pp", "1"], {**TP_CONFIG, "tensor_parallel_degree": 4}, 1,
                   {"pipeline_parallel_degree": 1, "tensor_parallel_degree": 4, "rdp": 1}),
    "tp2xsdp2-to-sdp4": ("tp2-sdp2", ["--tp", "1", "--pp", "1", "--world", "4", "--sdp", "4"],
                         {**sdpw.CONFIG, "tensor_parallel_degree": 1, "sharded_data_parallel_degree": 4,
                          "microbatches": 1}, 1,
                         {"tensor_parallel_degree": 1, "rdp": 4, "sharded_data_parallel_degree": 4}),
    "zero1-rdp2-to-rdp4": ("zero1-rdp2", ["--tp", "1", "--pp", "1", "--world", "4"], ZERO1_CONFIG, 1,
                           {"tensor_parallel_degree": 1, "rdp": 4}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RESHARDS))
def test_reshard_resumes_like_one_uninterrupted_process(runs, tmp_path, capsys, case):
    """2 AdamW steps at layout A, reshard, 2 more at layout B (a fresh model with other weights
    resumes; the same 4 rows per step): the weights equal 4 single-process steps on the same data."""
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    trained, flags, config, b, expected = RESHARDS[case]
    root, _ = runs[trained]
    out = str(tmp_path / "resharded")
    assert main(["checkpoint", "reshard", os.path.join(root, "gpt2"), "--out", out, *flags]) == 0
    capsys.readouterr()
    assert main(["checkpoint", "inspect", out, "--format", "json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {k: rep["layout"][k] for k in expected} == expected and rep["complete"]
    world = config.get("tensor_parallel_degree", 1) * config.get("pipeline_parallel_degree", 1) * expected["rdp"]
    per_rank = run_ranks(cw.resume_and_train, world, config, {"model": "gpt2", "seed": 40, "start": 2, "steps": 2},
                         out, b)
    assert per_rank[0]["dp"] * b == 4 and per_rank[0]["user_content"] == {"step": 2}
    _, weights = _reference_adamw_state("gpt2", 40, dp=2, steps=4, clip=config.get("sdp_gradient_clipping"))
    got = _torch(per_rank[0]["state_dict"])
    assert sorted(got) == sorted(weights)
    for key, value in weights.items():
        tpd._close(got[key], value, key, tpd.ADAMW_ATOL)


@pytest.mark.slow
def test_reshard_refuses_what_it_cannot_recut_before_writing(runs, tmp_path, capsys):
    pp_root, sdp_root = runs["pp2-tp2"][0], runs["tp2-sdp2"][0]
    out = tmp_path / "out"
    cases = [
        ([os.path.join(pp_root, "gpt2"), "--tp", "2", "--pp", "1"], "allowed: --pp 2"),
        ([os.path.join(pp_root, "gpt2"), "--tp", "3", "--pp", "2"], "--tp 3: transformer.h.0.attn.c_attn.weight"),
        ([os.path.join(pp_root, "gpt2"), "--tp", "2", "--pp", "2", "--world", "6"], "--world 6 is not a multiple"),
        ([os.path.join(sdp_root, "gpt2"), "--tp", "2", "--pp", "1", "--rdp", "4", "--sdp", "1"],
         "allowed: --sdp values above 1"),
        ([os.path.join(pp_root, "gpt2"), "--tp", "2", "--pp", "2", "--sdp", "2"], "allowed: --sdp 1"),
        ([os.path.join(sdp_root, "gpt2"), "--tp", "1", "--pp", "1", "--rdp", "3"], "--sdp 2 does not divide"),
        ([os.path.join(sdp_root, "gpt2"), "--tp", "2", "--pp", "1"],  # rdp 1: no sdp divides it; say what works
         "allowed: no --sdp at rdp 1: sharded data parallelism needs a reduced data-parallel degree of 2 or more; "
         "give --rdp R or --world W"),
    ]
    for argv, message in cases:
        assert main(["checkpoint", "reshard", *argv, "--out", str(out)]) == 2, argv
        assert message in capsys.readouterr().err, argv
        assert not out.exists()


@pytest.mark.slow
def test_optimizer_state_that_cannot_be_matched_to_its_parameters_is_refused_by_group(runs, tmp_path, capsys):
    """The grouped tp 2 checkpoint without the parameter names smp2ds records per group (as one written before it
    did): PyTorch numbers the state in the groups' order, not the model's, so the shapes disagree; every export
    refuses, naming the position, the group and the parameter, and writes nothing."""
    from smp2ds.engine.checkpoint_tools.reading import load_weights

    copy = os.path.join(str(tmp_path), "unnamed")
    shutil.copytree(os.path.join(runs["tp2"][0], GROUPED), copy)
    part = os.path.join(copy, "step2_partial")
    os.remove(os.path.join(part, "smp2ds_manifest.json"))
    for name in os.listdir(part):
        if name.startswith("optimizer_states_"):
            obj = load_weights(os.path.join(part, name), mmap=False, deepspeed_state=True)
            assert len(obj["smp2ds"].pop("param_names")) == 2  # what the engine recorded: both groups
            torch.save(obj, os.path.join(part, name))
    for to in ("dcp", "deepspeed-universal"):
        out = tmp_path / to
        assert main(["checkpoint", "export", copy, "--to", to, str(out), "--model-type", "gpt2",
                     "--num-attention-heads", "4"]) == 1
        err = capsys.readouterr().err
        assert re.search(r"at position \d+ of parameter group \d \(taken as \S+\) has shape", err) and "does not record which parameter each position is" in err
        assert not out.exists() and not (tmp_path / f"{to}.smp2ds-partial").exists()
