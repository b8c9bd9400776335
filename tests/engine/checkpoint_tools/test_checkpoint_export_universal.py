"""``smp2ds checkpoint export --to deepspeed-universal``: DeepSpeed's universal checkpoint, loaded natively.

Proof: checkpoints the engine wrote at tp 2 x pp 2, tp 2 x sdp 2 and ZeRO-1 over rdp 2 (2 AdamW steps)
are exported; a plain DeepSpeed script (``deepspeed.initialize`` of a Hugging Face GPT-2 with a
torch AdamW, ``"checkpoint": {"load_universal": true}``) at ZeRO-1 and ZeRO-3 over 3 CPU ranks (another
data-parallel size) loads it with ``engine.load_checkpoint`` and trains 2 more steps. Its losses
and final weights equal one uninterrupted single process training all 4 steps.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from smp2ds.cli import main
from tests._dist import run_ranks
from tests.engine.checkpoint_tools.test_checkpoint_tools import _write_checkpoint
from tests.engine.workers import checkpoint_export_workers as xw

DS_WORLD = 3
CASES = [("pp2-tp2", 1), ("tp2-sdp2", 3), ("zero1-rdp2", 1), ("zero1-rdp2", 3)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return xw.smp_checkpoints(str(tmp_path_factory.getbasetemp() / "smp-export-checkpoints"))


@pytest.mark.slow
@pytest.mark.parametrize("layout,stage", CASES, ids=[f"{lay}-to-zero{s}" for lay, s in CASES])
def test_deepspeed_loads_the_universal_export_and_trains_like_one_uninterrupted_process(checkpoints, tmp_path,
                                                                                         capsys, layout, stage):
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    out = str(tmp_path / "universal")
    assert main(["checkpoint", "export", checkpoints[layout], "--to", "deepspeed-universal", out]) == 0
    assert "DeepSpeed universal checkpoint step2" in capsys.readouterr().err
    with open(os.path.join(out, "latest_universal")) as handle:
        assert handle.read() == "step2"
    zero = os.path.join(out, "step2", "zero")
    assert sorted(os.listdir(os.path.join(zero, "transformer.h.0.attn.c_attn.weight"))) == [
        "exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    ranks = run_ranks(xw.deepspeed_resume, DS_WORLD, out, stage)
    want = xw.reference(xw.LAYOUTS[layout][2])
    assert all(r["loaded"] is not None and r["global_steps"] == 2 * xw.SAVED_STEPS for r in ranks)
    for got in ranks:
        tpd._close(got["losses"], want["losses"][xw.SAVED_STEPS:], f"{layout} zero{stage}: losses after the load",
                   1e-5)
    weights = {k: torch.from_numpy(v) for k, v in ranks[0]["state_dict"].items()}
    assert sorted(weights) == sorted(want["weights"])
    for key, value in want["weights"].items():
        tpd._close(weights[key], value, f"{layout} zero{stage}: {key}", tpd.ADAMW_ATOL)


@pytest.mark.slow
def test_the_native_deepspeed_config_of_the_job_continues_the_universal_export(checkpoints, tmp_path, capsys):
    """The exit pair for a plain DeepSpeed script: `convert --to deepspeed --native` of the job's SMP parameters
    (shard_optimizer_state: ZeRO-1; batch 1 a rank over 3 ranks) is the script's DeepSpeed config, unchanged but for
    load_universal; it loads the universal export and trains on like one uninterrupted process."""
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    smp = tmp_path / "smp.json"
    smp.write_text(json.dumps(xw.LAYOUTS["zero1-rdp2"][1]), encoding="utf-8")
    assert main(["convert", str(smp), "--to", "deepspeed", "--native", "--world-size", str(DS_WORLD),
                 "--batch-size", "1", "-o", str(tmp_path / "ds.json")]) == 0
    assert "differs from SMP: batch: SMP's per-rank batch 1" in capsys.readouterr().err
    config = json.loads((tmp_path / "ds.json").read_text())
    assert (config["zero_optimization"], config["train_batch_size"]) == ({"stage": 1}, DS_WORLD)
    out = str(tmp_path / "universal")
    assert main(["checkpoint", "export", checkpoints["zero1-rdp2"], "--to", "deepspeed-universal", out]) == 0
    ranks = run_ranks(xw.deepspeed_resume, DS_WORLD, out, 1, 2, config)
    want = xw.reference(None)
    for got in ranks:
        tpd._close(got["losses"], want["losses"][xw.SAVED_STEPS:], "native config: losses after the load", 1e-5)
    weights = {k: torch.from_numpy(v) for k, v in ranks[0]["state_dict"].items()}
    for key, value in want["weights"].items():
        tpd._close(weights[key], value, f"native config: {key}", tpd.ADAMW_ATOL)


def test_a_checkpoint_without_optimizer_state_is_refused_before_writing(tmp_path, capsys):
    _write_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "universal"
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--to", "deepspeed-universal", str(out)]) == 2
    assert "holds no optimizer state; --to deepspeed-universal" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), "--to", "deepspeed-universal", str(out),
                 "--model-type", "gpt2"]) == 2
    assert "--model-type: the checkpoint holds no SMP distributed-transformer names" in capsys.readouterr().err
