"""DeepSpeed's bf16 switches, set to the fastest values that keep SMP's bf16 semantics. Pure.

What SMP did, from its public documentation:

* ``smp.DistributedOptimizer``'s ``static_loss_scale``, ``dynamic_loss_scale`` and ``dynamic_loss_args`` are
  "effective only for FP16 training": bf16 ran without a loss scaler.
* Its 16-bit optimizer is a modified Apex ``FP16_Optimizer``; with a static scale Apex's ``LossScaler``
  never reports an overflow, so a step with inf/nan gradients was applied, not skipped.
* bf16 is documented only with sharded data parallelism, whose optimizer clips inside ``step()``
  (``sdp_gradient_clipping``) and so computes the global gradient norm every step.

What DeepSpeed does with the switches depends on the optimizer wrapper its engine picks, so the choice is
made per ZeRO stage (:func:`bf16_path`):

* ``zero1`` (``shard_optimizer_state``): ``check_grad_overflow`` true scans the gradient partitions for
  inf/nan before each step (host synchronisation plus an all-reduce) and skips a step on a hit; false
  drops the scan and applies every step, as SMP did. Chosen: false.
* ``zero0`` (plain data parallelism): the stage-0 bf16 wrapper scans and skips whatever
  ``check_grad_overflow`` says. The plan writes true, which is what happens.
* ``zero3`` (sharded data parallelism): ZeRO-3 does not read ``check_grad_overflow``; it skips a step whose
  gradient norm is inf/nan, the norm it computes for the clipping anyway. The plan writes true.
* ``pipeline`` (stage 0): DeepSpeed's bf16 optimizer skips a step with an inf/nan norm (one check).
  ``immediate_grad_update`` true would add each micro-batch's gradient into the fp32 master gradient
  at once. SMP summed the micro-batches in the bf16 gradients of its bf16 parameters, so with more
  than one micro-batch the sums would differ. Chosen: false everywhere.

``torch_autocast`` is never turned on: it keeps fp32 parameters and lets autocast pick each op's dtype,
while SMP's 16-bit module wrapper casts the parameters to bf16 (scripts see bf16 weights, and every op
runs in bf16), so losses would change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .zero import zero_stage

Bf16Path = Literal["zero0", "zero1", "zero3", "pipeline"]

NO_AUTOCAST = ("torch_autocast stays off: it keeps fp32 weights and picks each op's dtype, while SMP's 16-bit "
               "wrapper casts the weights to bf16")
ACCUMULATE_IN_BF16 = ("immediate_grad_update false: micro-batch gradients add up in bf16, as on SMP's bf16 "
                      "parameters (true adds them into fp32 at once: other sums when microbatches > 1)")


@dataclass(frozen=True, kw_only=True)
class Bf16Choice:
    """The values written to ``/deepspeed/bf16`` for one layout, and why."""

    path: Bf16Path
    """Which DeepSpeed optimizer wrapper runs the step (it decides which switches have an effect)."""
    check_grad_overflow: bool
    """DeepSpeed's per-step inf/nan scan of the gradients, with the step skipped on a hit."""
    immediate_grad_update: bool = False
    """Accumulate micro-batch gradients into the fp32 master gradients in backward."""
    reason: str
    """One line for ``smp2ds explain``: what the values do here and why they keep SMP's semantics."""


REASONS: dict[Bf16Path, str] = {
    "zero1": ("check_grad_overflow false: SMP had no bf16 loss scaler and applied every step; DeepSpeed's ZeRO-1 "
              "default scans the gradients each step (a host sync and an all-reduce) and skips a step with inf/nan "
              "gradients, so false is faster and, like SMP, applies such a step"),
    "zero0": ("check_grad_overflow true: DeepSpeed's stage-0 bf16 wrapper scans the gradients and skips a step with "
              "inf/nan gradients whatever this says (SMP applied such a step; finite steps are the same)"),
    "zero3": ("check_grad_overflow true: ZeRO-3 does not read it; it skips a step whose gradient norm is inf/nan, the "
              "norm that SMP's sharded data parallelism computed for sdp_gradient_clipping anyway"),
    "pipeline": ("check_grad_overflow true: DeepSpeed's pipeline bf16 optimizer does not read it; it skips a step "
                 "whose gradient norm is inf/nan (SMP applied such a step; finite steps are the same)"),
}


def bf16_path(params: Mapping[str, Any]) -> Bf16Path:
    """The DeepSpeed optimizer wrapper a bf16 run of these resolved SMP parameters gets."""
    stage = zero_stage(params)
    if stage == 3:
        return "zero3"
    if stage >= 1:
        return "zero1"  # DeepSpeed's ZeRO-1/2 optimizer, with or without pipeline stages
    return "pipeline" if params.get("pipeline_parallel_degree", 1) > 1 else "zero0"


def bf16_choice(params: Mapping[str, Any]) -> Bf16Choice:
    """The bf16 switches for these resolved SMP parameters."""
    path = bf16_path(params)
    return Bf16Choice(path=path, check_grad_overflow=path != "zero1", reason=REASONS[path])


def bf16_block(params: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed's ``bf16`` block with every switch written out (``{"enabled": False}`` without bf16)."""
    if not params.get("bf16"):
        return {"enabled": False}
    choice = bf16_choice(params)
    return {"enabled": True, "check_grad_overflow": choice.check_grad_overflow,
            "immediate_grad_update": choice.immediate_grad_update}


def bf16_note(params: Mapping[str, Any]) -> str:
    """The fate note of ``bf16: true``: the switches chosen and why."""
    return f"bf16 training (no loss scaling); {bf16_choice(params).reason}; {ACCUMULATE_IN_BF16}; {NO_AUTOCAST}"
