"""``smp2ds checkpoint export --to dcp``: a torch.distributed.checkpoint directory other jobs load natively.

Proof: checkpoints the engine wrote at tp 2 x pp 2, tp 2 x sdp 2 and ZeRO-1 over rdp 2 (2 AdamW steps)
are exported; an FSDP2 job (``fully_shard``, gloo, 3 CPU ranks: another world size, uneven shards)
with a fresh model loads the export with ``dcp.load`` + ``set_state_dict`` and trains 2 more steps.
Its losses and final weights equal one uninterrupted single process training all 4 steps. The
single-process cases check the exported keys, the layout ``set_state_dict`` takes, and refusals.
"""

from __future__ import annotations

import os

import pytest
import torch

from smp2ds.cli import main
from tests._dist import run_ranks
from tests.engine.checkpoint_tools.test_checkpoint_tools import _write_checkpoint
from tests.engine.workers import checkpoint_export_workers as xw

FSDP_WORLD = 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return xw.smp_checkpoints(str(tmp_path_factory.getbasetemp() / "smp-export-checkpoints"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(xw.LAYOUTS))
def test_fsdp2_at_another_world_size_resumes_the_export_like_one_uninterrupted_process(checkpoints, tmp_path,
                                                                                          capsys, layout):
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    out = str(tmp_path / "dcp")
    assert main(["checkpoint", "export", checkpoints[layout], "--to", "dcp", out]) == 0
    assert "model and optim state" in capsys.readouterr().err
    assert os.path.isfile(os.path.join(out, ".metadata"))
    ranks = run_ranks(xw.fsdp2_resume, FSDP_WORLD, out)
    want = xw.reference(xw.LAYOUTS[layout][2])
    assert all(r["steps_after_load"] == [float(xw.SAVED_STEPS)] for r in ranks)
    for got in ranks:
        tpd._close(got["losses"], want["losses"][xw.SAVED_STEPS:], f"{layout}: losses after the load", 1e-5)
    weights = {k: torch.from_numpy(v) for k, v in ranks[0]["state_dict"].items()}
    assert sorted(weights) == sorted(want["weights"])
    for key, value in want["weights"].items():
        tpd._close(weights[key], value, f"{layout}: {key}", tpd.ADAMW_ATOL)


def test_the_export_is_what_get_state_dict_and_set_state_dict_use(tmp_path, capsys):
    """A model-only checkpoint (no optimizer files): the ``model`` entry loads into a plain model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from tests.engine.workers import tp_workers as tw

    full = _write_checkpoint(str(tmp_path / "ckpt"))
    out = str(tmp_path / "dcp")
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--to", "dcp", out]) == 0
    assert "with model state" in capsys.readouterr().err
    model = tw.hf_model("gpt2", 99)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=out)
    set_model_state_dict(model, state["model"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in full.items())
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "dcp"]  # no staging folder left behind


def test_export_refusals_name_the_flag_and_write_nothing(tmp_path, capsys):
    _write_checkpoint(str(tmp_path / "ckpt"))
    ckpt, taken = str(tmp_path / "ckpt"), tmp_path / "taken"
    taken.mkdir()
    (taken / "file").write_text("x")
    cases = [(["--to", "dcp", str(taken)], "--to dcp " + str(taken) + ": exists and is not an empty folder"),
             (["--to", "dcp", str(tmp_path / "o"), "--model-type", "gpt2"],
              "--model-type: the checkpoint holds no SMP distributed-transformer names"),
             (["--to", "dcp", str(tmp_path / "o"), "--num-attention-heads", "4"],
              "--num-attention-heads: the checkpoint holds no SMP"),
             (["--to", "onnx", str(tmp_path / "o")], "--to 'onnx': allowed hf, dcp"),
             (["--to", "hf", str(tmp_path / "o")], "give one of --config FILE and --model-type TYPE: the checkpoint's "
              "user content holds no model_config"),
             (["--to", "hf", str(tmp_path / "o"), "--names", "smp"], "--names smp: only for --to dcp")]
    for argv, message in cases:
        assert main(["checkpoint", "export", ckpt, *argv]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "taken"]


def test_the_optimizer_layout_is_get_optimizer_state_dicts(tmp_path):
    """The ``optim`` entry has the keys, types and nesting torch's own FQN optimizer state dict has."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from smp2ds.engine.checkpoint_tools.dcp_export import optimizer_dict
    from tests.engine.workers import tp_workers as tw

    model = tw.hf_model("gpt2", 3)
    opt = tw.make_optimizer("adamw", model.parameters())
    model(input_ids=xw.batch(0), labels=xw.batch(0), use_cache=False).loss.backward()
    opt.step()
    native = get_optimizer_state_dict(model, opt)
    consolidated = {k: {**v, "step": int(v["step"])} for k, v in native["state"].items()}
    ours = optimizer_dict(consolidated, native["param_groups"])
    assert sorted(ours["state"]) == sorted(native["state"])
    for name, entry in native["state"].items():
        assert sorted(ours["state"][name]) == sorted(entry)
        assert ours["state"][name]["step"].dtype == entry["step"].dtype and ours["state"][name]["step"].dim() == 0
    assert ours["param_groups"] == native["param_groups"]
