"""The bf16 switches the planner chooses (smp2ds.translator.bf16_settings) against the bf16 block smp2ds wrote
before (``{"enabled": true}``): same losses and weights on finite steps; where a step has inf gradients, ZeRO-1
now applies it as SMP did (weights become non-finite) instead of skipping it. Real ranks (tests/_dist.py, gloo).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._dist import run_ranks
from tests.engine.workers import bf16_settings_workers as bw

B, STEPS, INJECT = 4, 4, 2
ZERO1 = {"ddp": True, "bf16": True, "shard_optimizer_state": True, "microbatches": 2}
ZERO0 = {"ddp": True, "bf16": True, "microbatches": 2}


def _same_weights(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.slow
def test_zero1_finite_steps_equal_todays_settings():
    chosen = run_ranks(bw.run_bf16, 2, ZERO1, None, B, STEPS, -1)
    today = run_ranks(bw.run_bf16, 2, ZERO1, bw.TODAY_BF16, B, STEPS, -1)
    assert chosen[0]["bf16"] == {"enabled": True, "check_grad_overflow": False, "immediate_grad_update": False}
    assert chosen[0]["optimizer"] == today[0]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert chosen[0]["dtype"] == "torch.bfloat16"
    for new, old in zip(chosen, today):
        assert [r["loss"] for r in new["record"]] == [r["loss"] for r in old["record"]]
        _same_weights(new["weights"], old["weights"])


@pytest.mark.slow
def test_zero1_step_with_inf_gradients_is_applied_as_smp_did():
    """SMP had no bf16 loss scaler, so nothing skipped a step: the inf reaches the weights. DeepSpeed's default
    (check_grad_overflow true) skipped it; the first steps are equal either way."""
    chosen = run_ranks(bw.run_bf16, 2, ZERO1, None, B, STEPS, INJECT)
    today = run_ranks(bw.run_bf16, 2, ZERO1, bw.TODAY_BF16, B, STEPS, INJECT)
    for new, old in zip(chosen, today):
        assert [r["loss"] for r in new["record"][:INJECT + 1]] == [r["loss"] for r in old["record"][:INJECT + 1]]
        assert old["record"][INJECT]["changed"] is False and old["record"][INJECT]["finite"] is True
        assert new["record"][INJECT]["changed"] is True and new["record"][INJECT]["finite"] is False
        assert all(r["finite"] for r in old["record"])


@pytest.mark.slow
def test_zero0_unchanged_even_with_inf_gradients():
    """Stage 0: DeepSpeed's bf16 wrapper checks and skips whatever the block says; the plan states it."""
    chosen = run_ranks(bw.run_bf16, 2, ZERO0, None, B, STEPS, INJECT)
    today = run_ranks(bw.run_bf16, 2, ZERO0, bw.TODAY_BF16, B, STEPS, INJECT)
    assert chosen[0]["bf16"]["check_grad_overflow"] is True
    for new, old in zip(chosen, today):
        assert new["record"] == old["record"]
        assert new["record"][INJECT]["changed"] is False
        _same_weights(new["weights"], old["weights"])
