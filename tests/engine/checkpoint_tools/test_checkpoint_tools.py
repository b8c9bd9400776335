"""``smp2ds checkpoint`` on hostile and broken folders (single process, fast).

The folder is an SMP-style partial checkpoint written here in the on-disk format (a GPT-2 cut by
the engine's own ``ShardSpec`` per tensor-parallel rank, two pipeline stages); the checkpoints real
multi-rank runs write are covered in ``test_checkpoint_tools_dist.py``. Every broken case must be
reported naming the file, with exit code 1 and no traceback, by both ``inspect`` and ``consolidate``.
"""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from smp2ds.cli import main
from smp2ds.engine.checkpoint_tools import safetensors_stream
from smp2ds.engine.nn.parallel.shards import ShardSpec
from tests.engine.workers import tp_workers as tw


def _write_checkpoint(folder: str) -> dict[str, torch.Tensor]:
    """A tp 2 x pp 2 partial checkpoint of a tiny GPT-2 (blocks 0 / 1 on stages 0 / 1, the tied
    embedding on both); returns the full state dict."""
    full = {k: v.clone() for k, v in tw.hf_model("gpt2", 7).state_dict().items()}
    cuts = {"attn.c_attn.weight": ShardSpec(1, 2, 3), "attn.c_attn.bias": ShardSpec(0, 2, 3),
            "mlp.c_fc.weight": ShardSpec(1, 2), "mlp.c_fc.bias": ShardSpec(0, 2),
            "attn.c_proj.weight": ShardSpec(0, 2), "mlp.c_proj.weight": ShardSpec(0, 2)}
    part = os.path.join(folder, "step5_partial")
    os.makedirs(part)
    for stage in (0, 1):
        keys = [k for k in full if f".h.{stage}." in k or k in ("transformer.wte.weight", "lm_head.weight")
                or (stage == 0 and k == "transformer.wpe.weight") or (stage == 1 and "ln_f" in k)]
        for rank in (0, 1):
            sd: dict = {"_smp_is_partial": True}
            for key in keys:
                spec = next((s for suffix, s in cuts.items() if key.endswith(suffix)), None)
                sd[key] = spec.local(full[key], rank) if spec else full[key].clone()
            torch.save(sd, os.path.join(part, f"model_{stage}_{rank}.pt"))
    torch.save({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, os.path.join(part, "smp_config.pt"))
    with open(os.path.join(folder, "newest"), "w") as handle:
        handle.write("step5_partial\n")
    return full


@pytest.fixture
def ckpt(tmp_path) -> tuple[str, dict]:
    return str(tmp_path / "ckpt"), _write_checkpoint(str(tmp_path / "ckpt"))


def _inspect(capsys, path: str) -> tuple[int, dict, str]:
    rc = main(["checkpoint", "inspect", path, "--format", "json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def _consolidate(capsys, path: str, out: str) -> tuple[int, str]:
    rc = main(["checkpoint", "consolidate", path, "--out", out, "--quiet"])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_an_smp_style_folder_consolidates_to_the_full_state_dict(ckpt, capsys, tmp_path):
    from safetensors.torch import load_file

    path, full = ckpt
    rc, rep, _ = _inspect(capsys, path)
    assert rc == 0 and rep["complete"] and rep["kind"] == "SMP partial checkpoint" and not rep["manifest"]
    assert rep["tensor_parallel_split"] == 2 * 6  # six cut tensors per block, two blocks
    rc, _ = _consolidate(capsys, path, str(tmp_path / "f.safetensors"))
    got = load_file(str(tmp_path / "f.safetensors"))
    assert rc == 0 and sorted(got) == sorted(full)
    assert all(torch.equal(got[k], v) for k, v in full.items())


def _broken(case: str, part: str) -> str:
    """Break the folder one way; return the file the report must name."""
    if case == "missing rank file":
        os.unlink(os.path.join(part, "model_1_1.pt"))
        return "model_1_1.pt"
    if case == "truncated file":
        file = os.path.join(part, "model_0_1.pt")
        with open(file, "r+b") as handle:
            handle.truncate(os.path.getsize(file) // 2)
        return "model_0_1.pt"
    if case == "foreign pickle":
        with open(os.path.join(part, "model_1_0.pt"), "wb") as handle:
            pickle.dump(ValueError("not a checkpoint"), handle)
        return "model_1_0.pt"
    if case == "disagreeing shapes":
        file = os.path.join(part, "model_0_1.pt")
        sd = torch.load(file, weights_only=True)
        sd["transformer.h.0.mlp.c_fc.weight"] = sd["transformer.h.0.mlp.c_fc.weight"][:, :-1].clone()
        torch.save(sd, file)
        return "model_0_1.pt"
    if case == "not a torch file":
        with open(os.path.join(part, "model_0_0.pt"), "w") as handle:
            handle.write("hello")
        return "model_0_0.pt"
    raise ValueError(case)


@pytest.mark.parametrize("case", ["missing rank file", "truncated file", "foreign pickle", "disagreeing shapes",
                                  "not a torch file"])
def test_a_broken_folder_is_named_by_file_exit_1_and_no_traceback(ckpt, capsys, tmp_path, case):
    path, _ = ckpt
    name = _broken(case, os.path.join(path, "step5_partial"))
    rc, rep, err = _inspect(capsys, path)
    assert rc == 1 and not rep["complete"], rep
    assert any(os.path.basename(p["file"]) == name for p in rep["problems"]), rep["problems"]
    assert "Traceback" not in err
    rc = main(["checkpoint", "inspect", path])
    text = capsys.readouterr()
    assert rc == 1 and "INCOMPLETE" in text.out and name in text.out and "Traceback" not in text.out + text.err
    rc, text = _consolidate(capsys, path, str(tmp_path / "out.safetensors"))
    assert rc == 1 and name in text and "Traceback" not in text
    assert not os.path.exists(tmp_path / "out.safetensors")


def test_a_foreign_pickle_is_never_executed(ckpt, capsys, tmp_path):
    path, _ = ckpt
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(path, "step5_partial", "model_0_0.pt"), "wb") as handle:
        pickle.dump(Payload(), handle)
    rc, rep, _ = _inspect(capsys, path)
    assert rc == 1 and not marker.exists()
    assert any("weights_only" in p["message"] for p in rep["problems"])


def test_unreadable_paths_and_refused_arguments(capsys, tmp_path, ckpt):
    rc, rep, _ = _inspect(capsys, str(tmp_path / "nowhere"))
    assert rc == 1 and rep["problems"][0]["file"].endswith("nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, rep, _ = _inspect(capsys, str(empty))
    assert rc == 1 and "no partial model files" in rep["problems"][0]["message"]
    path, _ = ckpt
    rc, rep, _ = _inspect(capsys, path + "/step5_partial")  # the partial folder itself works too
    assert rc == 0 and rep["tag"] == "step5"
    assert main(["checkpoint", "inspect", path, "--tag", "step9"]) == 1
    assert "no checkpoint with tag 'step9'" in capsys.readouterr().out
    assert main(["checkpoint", "consolidate", path, "--out", str(tmp_path / "x"), "--with-optimizer"]) == 1
    assert "holds no optimizer state" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")
    assert main(["checkpoint", "export", path, "--to", "onnx", str(tmp_path / "x"), "--model-type", "gpt2"]) == 2
    assert "--to 'onnx': allowed hf" in capsys.readouterr().err
    assert main(["checkpoint", "export", path, "--to", "hf", str(tmp_path / "x"), "--model-type", "gpt2"]) == 2
    assert "--num-attention-heads" in capsys.readouterr().err


def test_the_streamed_safetensors_file_is_what_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(4).to(torch.bfloat16),
               "d": torch.zeros(0, 3), "e": torch.tensor([True, False])}
    out = str(tmp_path / "s.safetensors")
    writer = safetensors_stream.StreamWriter(out, [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()])
    for key, value in tensors.items():
        writer.write(key, value)
    writer.close()
    got = load_file(out)
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    writer = safetensors_stream.StreamWriter(str(tmp_path / "t"), [("a", (2,), torch.float32)])
    with pytest.raises(ValueError, match="announced"):
        writer.write("a", torch.zeros(3))
    writer.abort()
    assert not os.listdir(tmp_path / "t") if os.path.isdir(tmp_path / "t") else not os.path.exists(tmp_path / "t")


def test_the_trainer_layout_of_an_smp_run_is_read(ckpt, capsys, tmp_path):
    """Hugging Face Trainer checkpoints of SMP runs: ``pytorch_model.bin_<pp>_<tp>``, ``optimizer.pt_<pp>_<tp>``,
    ``trainer_state.json`` for the step."""
    from safetensors.torch import load_file

    path, full = ckpt
    trainer = tmp_path / "checkpoint-40"
    os.rename(os.path.join(path, "step5_partial"), trainer)
    for stage in (0, 1):
        for rank in (0, 1):
            os.rename(trainer / f"model_{stage}_{rank}.pt", trainer / f"pytorch_model.bin_{stage}_{rank}")
            torch.save({"state": {}}, trainer / f"optimizer.pt_{stage}_{rank}.pt")
    (trainer / "trainer_state.json").write_text(json.dumps({"global_step": 40}))
    (trainer / "user_content.pt").touch()  # the Trainer touches an empty one
    rc, rep, _ = _inspect(capsys, str(trainer))
    assert rc == 0 and rep["kind"] == "Hugging Face Trainer checkpoint (SMP)" and rep["tag"] == "step 40", rep
    assert rep["optimizer_state"] and rep["user_content"] and len(rep["model_files"]) == 4
    os.unlink(trainer / "optimizer.pt_1_0.pt")
    rc, rep, _ = _inspect(capsys, str(trainer))
    assert rc == 1 and [os.path.basename(p["file"]) for p in rep["problems"]] == ["optimizer.pt_1_0.pt"]
    rc, _ = _consolidate(capsys, str(trainer), str(tmp_path / "f.safetensors"))
    assert rc == 1  # a checkpoint with a problem is refused whole, even when the weights are there
    torch.save({"state": {}}, trainer / "optimizer.pt_1_0.pt")
    rc, _ = _consolidate(capsys, str(trainer), str(tmp_path / "f.safetensors"))
    got = load_file(str(tmp_path / "f.safetensors"))
    assert rc == 0 and all(torch.equal(got[k], v) for k, v in full.items())


_SHAPES = {"a": (7,), "b": (5, 3), "c": (1,), "d": (2, 2)}
"""Parameter sizes no shard count divides: ZeRO-3 pads each, ZeRO-1 cuts across them and pads the end."""


@pytest.mark.parametrize("stage,count", [(3, 3), (3, 4), (1, 3), (1, 4)])
def test_flat_optimizer_partitions_round_trip_with_padding(tmp_path, stage, count):
    """What reshard writes for each rank, consolidate cuts back into the same per-parameter state;
    files of the wrong ranks (swapped) are refused, since their master weights no longer fit."""
    from smp2ds.engine.checkpoint_tools import zero1_partitions, zero_partitions

    kind = zero_partitions if stage == 3 else zero1_partitions
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=g) for n, s in _SHAPES.items()}
    states = [{"step": torch.tensor(3.0), "exp_avg": torch.randn(s, generator=g), "exp_avg_sq": torch.rand(s, generator=g)}
              for s in _SHAPES.values()]
    group = {"param_groups": [{"lr": 0.5, "params": [0]}], "state": {}}
    template = ({"partition_count": count, kind.INNER: group, kind.MASTER: []} if stage == 3 else
                {kind.BASE: group, kind.MASTER: [], kind.MAPPINGS: [{}], "partition_count": [count]})
    names = list(_SHAPES)
    files = []
    for rank in range(count):
        body = kind.partition_state(template, names, list(weights.values()), states, count, rank)
        files.append(str(tmp_path / f"optimizer_states_0_0_{rank}.pt"))
        torch.save({"ds_optimizer": body, "smp2ds": {"zero_stage": stage, "precision": "fp32"}}, files[-1])
    total = sum(w.numel() for w in weights.values())
    masters = [kind.read(f, count)[kind.MASTER][0].numel() for f in files]
    if stage == 3:
        assert masters == [sum(-(-w.numel() // count) for w in weights.values())] * count
    else:
        assert sum(masters) == total and len(set(masters[:-1])) == 1 and masters[-1] <= masters[0]
    got = kind.unflatten(files, weights, names)
    assert list(got) == names and kind.hyperparameters(files[0], count) == {"lr": 0.5}
    for name, want in zip(names, states):
        assert int(got[name]["step"]) == 3
        assert all(torch.equal(got[name][k], want[k]) for k in ("exp_avg", "exp_avg_sq")), name
    from smp2ds.engine.exceptions import SMPCheckpointError

    with pytest.raises(SMPCheckpointError, match="differ from the model file's"):
        kind.unflatten([files[1], files[0], *files[2:]], weights, names)


def test_a_tensor_needing_no_join_is_its_copy_on_write_mapping(tmp_path):
    """``consolidate.join_pieces`` hands over a single (or replicated) piece as it was read, a memory-mapped tensor,
    instead of copying it (the largest tensor's pages once, not twice); a caller that changes it changes its private
    copy of the pages, never the checkpoint file; pieces that are cut are joined into a new tensor."""
    from smp2ds.engine.checkpoint_tools.consolidate import join_pieces
    from smp2ds.engine.checkpoint_tools.shard_rules import Split

    path = tmp_path / "model_0_0.pt"
    torch.save({"w": torch.arange(6.0).reshape(3, 2)}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)["w"]
    whole = join_pieces([mapped], None)
    assert whole.data_ptr() == mapped.data_ptr()  # no copy
    whole += 1
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(6.0).reshape(3, 2))  # file untouched
    cut = join_pieces([torch.zeros(1, 2), torch.ones(1, 2)], Split(0))
    assert torch.equal(cut, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
