"""SMP's sharded-data-parallel checkpoint layout, written and read (2 CPU ranks, ``sharded_data_parallel_degree`` 2).

SMP's GPT-2 example saves sdp training with ``smp.save_checkpoint(..., partial=True)`` and rebuilds the full model
with its folder's ``sharded_data_parallel_checkpoint.py`` helper, which reads ``<tag>/model_0.pt`` (``module``),
``<tag>/optimizer_<i>.pt`` (DeepSpeed's ZeRO-3 state at the top level: ``partition_count``, ``fp32_flat_groups``)
and the user content's ``param_shapes`` / ``buffer_names``. Proofs here:

* the helper's documented algorithm (re-implemented below from its description) rebuilds, from our checkpoint, the
  model the run trained, equal to ``smp2ds checkpoint export --to hf`` (Hugging Face GPT-2, and SMP's distributed
  transformer translated to Hugging Face names), which takes the model's config from the user content;
* a checkpoint resumes and continues equal to the uninterrupted run, both as smp2ds writes it and as SMP wrote it
  (parameters as empty placeholders, their values only in the optimizer files, no manifest or smp2ds facts);
* the offline tools read SMP-written folders and give what they give for ours; what they cannot read is named.
"""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from smp2ds.cli import main
from tests._dist import run_ranks
from tests.engine.workers import sdp_layout_workers as w

pytestmark = pytest.mark.slow
FINAL = "sharded_data_parallel_final_full_1"
MODELS = ("gpt2", "gpt2_replaced")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """{model: (checkpoint root, rank 0's results)}: trained and saved once per model."""
    out = {}
    for model in MODELS:
        root = str(tmp_path_factory.mktemp(model))
        out[model] = (root, _torch(run_ranks(w.train_and_save, 2, model, root)[0]))
    return out


def _torch(value: object) -> object:
    if isinstance(value, dict):
        return {k: _torch(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_torch(v) for v in value]
    return torch.from_numpy(value) if hasattr(value, "dtype") and hasattr(value, "shape") else value


def smp_helper_full_state_dict(checkpoint_dir: str, tag: str | None = None) -> dict[str, torch.Tensor]:
    """What SMP's ``get_full_state_dict_from_sharded_data_parallel_checkpoint`` documents: ``newest`` names the
    tag; every ``optimizer_*.pt`` (natural order) gives its ``fp32_flat_groups`` joined; ``partition_count`` must
    equal the number of files; parameters in ``param_shapes`` order take ``ceil(numel / S)`` elements from each
    shard, cut to ``numel``; buffers come from ``model_0.pt``'s ``module`` by ``buffer_names``; ``module.`` is
    dropped from parameter names; all elements must be consumed."""
    if tag is None:
        with open(os.path.join(checkpoint_dir, "newest")) as handle:
            tag = handle.read().strip()
    folder = os.path.join(checkpoint_dir, tag)
    files = sorted((f for f in os.listdir(folder) if f.startswith("optimizer_") and f.endswith(".pt")),
                   key=lambda f: int(f[len("optimizer_"):-len(".pt")]))
    states = [torch.load(os.path.join(folder, f), weights_only=False) for f in files]
    count = states[0]["partition_count"]
    count = max(count) if isinstance(count, list) else count
    assert count == len(files), (count, files)
    flats = [torch.cat(s["fp32_flat_groups"], 0) for s in states]
    content = torch.load(os.path.join(folder, "user_content.pt"), weights_only=False)
    module = torch.load(os.path.join(folder, "model_0.pt"), weights_only=False)["module"]
    out = {k: v for k, v in module.items() if k in content["buffer_names"]}
    offset = 0
    for name, shape in ((n, s) for d in content["param_shapes"] for n, s in d.items()):
        name = name[len("module."):] if name.startswith("module.") else name
        size = math.ceil(shape.numel() / count)
        out[name] = torch.cat([f.narrow(0, offset, size) for f in flats]).narrow(0, 0, shape.numel()).view(shape)
        offset += size
    assert offset * count == flats[0].numel() * count
    return out


def _cli(*args: str) -> int:
    return main(["checkpoint", *args])


def test_the_switch_to_the_distributed_transformer_is_logged_once_on_rank_0(runs):
    assert runs["gpt2"][1]["wrap_log"] == []
    [line] = runs["gpt2_replaced"][1]["wrap_log"]
    assert line.startswith("smp.DistributedModel: 1 Hugging Face model part(s) replaced by SMP's distributed "
                           "transformer (tensor_parallel_degree 1)")


def test_the_folder_is_smps_layout(runs):
    root, _ = runs["gpt2"]
    with open(os.path.join(root, "newest")) as handle:
        assert handle.read() == FINAL + "\n"  # one tag: SMP's helper reads the whole file as the tag
    assert sorted(d for d in os.listdir(root) if not d.startswith(".")) == ["newest", FINAL, "step2"]
    files = sorted(os.listdir(os.path.join(root, FINAL)))
    assert files == ["model_0.pt", "optimizer_0.pt", "optimizer_1.pt", "smp2ds_manifest.json", "smp_config.pt",
                     "user_content.pt"]
    shard = torch.load(os.path.join(root, FINAL, "optimizer_1.pt"), weights_only=False)
    assert shard["partition_count"] == 2 and len(shard["fp32_flat_groups"]) == 2  # two groups: weight decay split
    assert "module" in torch.load(os.path.join(root, FINAL, "model_0.pt"), weights_only=False)


@pytest.mark.parametrize("model", MODELS)
def test_smp_helper_rebuilds_the_trained_model_equal_to_the_hf_export(runs, tmp_path, model):
    from smp2ds.engine.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2

    root, result = runs[model]
    full = smp_helper_full_state_dict(root, tag=FINAL)
    trained = result["final"]
    for name, tensor in full.items():
        assert torch.equal(tensor, trained[name]), name
    assert set(trained) - set(full) <= {"lm_head.weight", "lm_head.bias"}  # the tied head: "not reflected"
    if model == "gpt2_replaced":
        full = translate_state_dict_to_hf_gpt2(full, max_seq_len=16)
    # no --config / --model-type: the final save's user content holds model_config, as SMP's script saves it
    assert _cli("export", root, "--to", "hf", str(tmp_path / "hf")) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(full) ^ set(exported) <= {"lm_head.weight"}  # a tied head is stored once (or not at all)
    for name in set(full) & set(exported):
        assert torch.equal(full[name], exported[name]), name


def _as_smp_wrote_it(root: str, out: str, tag: str) -> str:
    """A copy of ``root``'s ``tag`` folder rewritten as SMP wrote it: ``module`` holds the parameters as empty
    placeholders (ZeRO-3's module state) and the buffers whole, the optimizer files DeepSpeed's dict alone, no
    manifest and no smp2ds configuration file; ``newest`` names ``tag``."""
    os.makedirs(out)
    shutil.copytree(os.path.join(root, tag), os.path.join(out, tag))
    folder = os.path.join(out, tag)
    content = torch.load(os.path.join(folder, "user_content.pt"), weights_only=False)
    params = {n for group in content["param_shapes"] for n in group} | {"lm_head.weight"}
    module = torch.load(os.path.join(folder, "model_0.pt"), weights_only=False)["module"]
    torch.save({"module": {k: torch.empty(0) if k in params else v for k, v in module.items()}},
               os.path.join(folder, "model_0.pt"))
    for name in ("optimizer_0.pt", "optimizer_1.pt"):
        shard = torch.load(os.path.join(folder, name), weights_only=False)
        shard.pop("smp2ds")
        torch.save(shard, os.path.join(folder, name))
    for name in ("smp2ds_manifest.json", "smp_config.pt"):
        os.remove(os.path.join(folder, name))
    with open(os.path.join(out, "newest"), "w") as handle:
        handle.write(tag)
    return out


@pytest.mark.parametrize("writer", ["smp2ds", "smp"])
def test_resume_continues_equal_to_the_uninterrupted_run(runs, tmp_path, writer):
    model = "gpt2" if writer == "smp2ds" else "gpt2_replaced"
    root, uninterrupted = runs[model]
    path, tag = (root, "step2") if writer == "smp2ds" else (_as_smp_wrote_it(root, str(tmp_path / "smp"), "step2"),
                                                            None)
    resumed = _torch(run_ranks(w.resume_and_train, 2, model, path, tag)[0])
    assert resumed["start"] == w.SAVE_AT
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(uninterrupted["losses"]),
                               rtol=0, atol=1e-6)
    for name, tensor in uninterrupted["final"].items():
        torch.testing.assert_close(resumed["final"][name], tensor, rtol=0, atol=1e-6, msg=name)


def test_offline_tools_read_an_smp_written_folder_as_ours(runs, tmp_path, capsys):
    root, _ = runs["gpt2"]
    smp_root = _as_smp_wrote_it(root, str(tmp_path / "smp"), FINAL)
    assert _cli("inspect", smp_root) == 0
    report = capsys.readouterr().out
    assert "SMP sharded-data-parallel checkpoint" in report and "status        complete" in report
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    assert _cli("consolidate", root, "--tag", FINAL, "--out", str(ours), "--with-optimizer") == 0
    assert _cli("consolidate", smp_root, "--out", str(theirs), "--with-optimizer") == 0
    a, b = load_file(str(ours)), load_file(str(theirs))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    opt_a = torch.load(str(tmp_path / "ours.optimizer.pt"), weights_only=False)
    opt_b = torch.load(str(tmp_path / "theirs.optimizer.pt"), weights_only=False)
    assert [g["weight_decay"] for g in opt_a["param_groups"]] == [0.01, 0.0]  # both groups, by parameter name
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for name, entry in opt_a["state"].items():
        assert all(torch.equal(entry[k], opt_b["state"][name][k]) for k in ("exp_avg", "exp_avg_sq")), name


def test_what_cannot_be_read_is_named(runs, tmp_path, capsys):
    root, _ = runs["gpt2"]
    smp_root = _as_smp_wrote_it(root, str(tmp_path / "smp"), FINAL)
    folder = os.path.join(smp_root, FINAL)
    content = torch.load(os.path.join(folder, "user_content.pt"), weights_only=False)
    torch.save({k: v for k, v in content.items() if k != "param_shapes"}, os.path.join(folder, "user_content.pt"))
    out = tmp_path / "m.safetensors"
    assert _cli("consolidate", smp_root, "--out", str(out)) == 1  # the folder is not whole: a fact is missing
    err = capsys.readouterr().err
    assert "empty placeholders" in err and "param_shapes" in err and not out.exists()
    os.remove(os.path.join(folder, "optimizer_1.pt"))
    assert _cli("inspect", smp_root) == 1
    assert "optimizer_1.pt: missing: optimizer state of shard rank 1" in capsys.readouterr().out
    assert _cli("export", os.path.join(root, "step2"), "--to", "hf", str(tmp_path / "hf")) == 2  # no model_config
    assert "the checkpoint's user content holds no model_config" in capsys.readouterr().err


@pytest.mark.parametrize("model", MODELS)
def test_the_sdp_checkpoint_exports_to_dcp_and_universal_in_hugging_face_names(runs, tmp_path, model):
    """SMP's final sdp save (two weight-decay groups, param_shapes and model_config in the user content) leaves for
    DCP and DeepSpeed's universal format: Hugging Face's names (the family from model_config), the trained weights,
    both groups with their settings."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from smp2ds.engine.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2

    root, result = runs[model]
    trained = result["final"]
    if model == "gpt2_replaced":
        trained = translate_state_dict_to_hf_gpt2(trained)
    assert _cli("export", root, "--to", "dcp", str(tmp_path / "dcp"), "--quiet") == 0
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "flat.pt"))
    flat = torch.load(str(tmp_path / "flat.pt"), weights_only=False)
    assert not any(".seq_layers." in k for k in flat["model"])
    for name, tensor in trained.items():
        assert torch.equal(flat["model"][name], tensor), name
    groups = flat["optim"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert sorted(n for g in groups for n in g["params"]) == sorted(flat["optim"]["state"])
    assert all(n.endswith("bias") or "ln_" in n for n in groups[1]["params"])
    assert _cli("export", root, "--to", "deepspeed-universal", str(tmp_path / "universal"), "--quiet") == 0
    zero = tmp_path / "universal" / FINAL / "zero"
    for name in flat["optim"]["state"]:
        for moment in ("exp_avg", "exp_avg_sq"):
            got = torch.load(str(zero / name / f"{moment}.pt"), weights_only=False)["param"]
            assert torch.equal(got, flat["optim"]["state"][name][moment]), (name, moment)


def test_weights_loaded_before_the_optimizer_train_like_the_run_that_started_from_them(runs):
    """``model.load_state_dict`` under sharded data parallelism before ``smp.DistributedOptimizer`` (DeepSpeed's
    engine has no fp32 master partitions yet: there is nothing to refresh) trains like the run built with those
    weights."""
    got = _torch(run_ranks(w.load_before_the_optimizer, 2, "gpt2")[0])
    _, want = runs["gpt2"]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-6)
    for name, tensor in want["final"].items():
        torch.testing.assert_close(got["final"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
