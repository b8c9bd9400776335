"""Multi-rank training through smp.* on DeepSpeed equals plain PyTorch on the union of the data.

Real processes (tests/_dist.py, gloo). Each run initialises SMP once and trains one fresh
model per phase (SGD with momentum, Adam, ...), so a handful of runs covers world sizes 2 and 4,
plain data parallelism and ZeRO-1 (``shard_optimizer_state``), microbatches 1, 2 and 4.
Tolerances: fp32, rtol 1e-5 / atol 1e-6 — the only difference from the reference is the order
of floating-point sums (mean over ranks vs. over one batch).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.workers import train_workers as tw

B = 8  # per-rank batch, divisible by every micro-batch count tested

RUNS = {
    # id: (world, smp config, phases)
    "w2-ddp-mb1": (2, {"ddp": True, "microbatches": 1}, [
        {"optimizer": "sgd", "seed": 1, "steps": 4, "scheduler": True, "clip": 0.05},
        {"optimizer": "adam", "seed": 2, "steps": 4, "bpps": 2},
        {"optimizer": "sgd", "seed": 3, "steps": 4, "grad_scaler": True, "inject_inf_at": 1},
    ]),
    "w2-zero1-mb2": (2, {"ddp": True, "microbatches": 2, "shard_optimizer_state": True}, [
        {"optimizer": "sgd", "seed": 4, "steps": 4},
        {"optimizer": "adam", "seed": 5, "steps": 4, "clip": 0.05},
    ]),
    "w4-zero1-mb4": (4, {"ddp": True, "microbatches": 4, "shard_optimizer_state": True}, [
        {"optimizer": "sgd", "seed": 6, "steps": 3},
        {"optimizer": "adam", "seed": 7, "steps": 3},
    ]),
    "w4-ddp-mb2": (4, {"ddp": True, "microbatches": 2}, [
        {"optimizer": "adam", "seed": 8, "steps": 4, "bpps": 2},
        {"optimizer": "sgd", "seed": 9, "steps": 3},
    ]),
}


def _close(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k, value in a.items():
        torch.testing.assert_close(torch.as_tensor(value).float(), torch.as_tensor(b[k]).float(), rtol=1e-5,
                                   atol=1e-6, msg=f"parameter {k}")


@pytest.mark.slow
@pytest.mark.parametrize("run_id", list(RUNS))
def test_training_equals_single_process_reference(run_id):
    world, config, phases = RUNS[run_id]
    per_rank = run_ranks(tw.run_training, world, config, phases, B)
    mb = config["microbatches"]
    for p, phase in enumerate(phases):
        ref = tw.reference(phase, world, B, mb)
        for rank, results in enumerate(per_rank):
            got = results[p]
            _close(got["weights"], ref["weights"])  # every rank ends with the reference weights
            assert got["is_optimizer"]
            if phase.get("scheduler"):
                assert got["lr"] == pytest.approx(0.1 * 0.5 ** (phase["steps"]))  # StepLR drove DeepSpeed's groups
            if phase.get("clip"):
                assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
                assert any(n > phase["clip"] for n in ref["norms"])  # clipping really happened
            for step, so in enumerate(got["outputs"]):
                hand = ref["mb_losses"][step][rank]
                assert so["type"] == "StepOutput" and len(so["outputs"]) == mb
                assert so["outputs"] == pytest.approx(hand, rel=1e-5, abs=1e-7)
                assert so["mean"] == pytest.approx(sum(hand) / mb, rel=1e-5)
                assert so["sum"] == pytest.approx(sum(hand), rel=1e-5)
                assert so["stack"] == pytest.approx(hand, rel=1e-5, abs=1e-7)
                assert so["concat_shape"] == (B, 1) and so["pred_equal"]
                assert so["sizes"] == [B // mb] * mb  # non-tensor leaves come back as plain lists
            if phase.get("grad_scaler"):
                # the injected inf skipped exactly that step and halved the scale
                assert got["skipped"] == [s == phase["inject_inf_at"] for s in range(phase["steps"])]
                assert got["scales"] == [2.0 ** 8 if s < phase["inject_inf_at"] else 2.0 ** 7
                                         for s in range(phase["steps"])]


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    steps, inject = 4, 2
    res = run_ranks(tw.run_fp16_overflow, 2, {"ddp": True, "microbatches": 2, "fp16": True}, B, steps, inject,
                    env={"SMP2DS_ALLOW_CPU_FP16": "1"})
    for rank_res in res:
        rec = rank_res["record"]
        assert all(r["dtype"] == "torch.float16" for r in rec)  # DeepSpeed's fp16 path really ran
        for step, r in enumerate(rec):
            if step == inject:
                assert r["overflow"] and not r["changed"]
                assert r["scale_after"] == r["scale_before"] / 2
            else:
                assert not r["overflow"] and r["changed"]
                assert r["scale_after"] == r["scale_before"]
        assert rec[0]["scale_before"] == 2.0 ** 10
    for k in res[0]["weights"]:
        assert (res[0]["weights"][k] == res[1]["weights"][k]).all()


@pytest.mark.slow
def test_save_load_continue_equals_uninterrupted(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    config = {"ddp": True, "microbatches": 2, "shard_optimizer_state": True}
    res = run_ranks(tw.run_checkpoint, 2, config, B, 3, ckpt)
    for r, out in enumerate(res):
        _close(out["resumed"], out["uninterrupted"])
        assert out["user_content"] == {"step": 3}
        assert out["v3"] == {"rank": r}
    files = res[0]["files"]
    assert "model_0_0.pt" in files and "user_content.pt" in files and "smp_config.pt" in files
    assert {"optimizer_states_0_0_0.pt", "optimizer_states_0_0_1.pt"} <= set(files)  # one ZeRO partition each
    assert not [f for f in files if f.startswith(".smp2ds-tmp")]  # atomic writes left nothing behind
    assert res[0]["newest"] == ["mid_partial"]
    assert "_smp_is_partial" in res[0]["full_keys"] and "0.weight" in res[0]["full_keys"]
    assert sorted(os.listdir(ckpt)) == ["mid_full.pt", "mid_partial", "newest", "v3obj_0_0_0.pt", "v3obj_0_0_1.pt"]


@pytest.mark.slow
def test_bf16_trains_through_deepspeeds_bf16_block():
    """bf16 keeps 8 mantissa bits, so the comparison with the fp32 reference is loose (2e-2) —
    enough to catch wrong gradients (those are off by O(1)) but not rounding."""
    phase = {"optimizer": "adam", "seed": 11, "steps": 3}
    per_rank = run_ranks(tw.run_training, 2, {"ddp": True, "microbatches": 2, "bf16": True}, [phase], B)
    ref = tw.reference(phase, 2, B, 2)
    for (got,) in per_rank:
        assert got["dtype"] == "torch.bfloat16"  # DeepSpeed's bf16 path really ran
        for k, v in ref["weights"].items():
            torch.testing.assert_close(torch.as_tensor(got["weights"][k]), v, rtol=2e-2, atol=2e-2, msg=k)
    for k in per_rank[0][0]["weights"]:
        assert (per_rank[0][0]["weights"][k] == per_rank[1][0]["weights"][k]).all()
