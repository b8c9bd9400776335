"""Rank bodies for tests/engine/api/test_bf16_settings_dist.py: one bf16 run with the bf16 block the plan writes or
with the block smp2ds wrote before (``{"enabled": true}``, DeepSpeed's defaults), an inf optionally injected.

Only ``plan.deepspeed["bf16"]`` is replaced, before the model exists: the engine builds its DeepSpeed config
from the plan, so the two runs differ in exactly those switches.
"""

from __future__ import annotations

import torch

from tests.engine.workers.train_workers import make_model, plain, poisoned_steps

TODAY_BF16 = {"enabled": True}
"""The bf16 block smp2ds wrote before it chose the switches (DeepSpeed's defaults apply)."""


def run_bf16(config: dict, bf16_block: dict | None, b: int, steps: int, inject_at: int) -> dict:
    """Train ``steps`` steps; at ``inject_at`` rank 1's loss is multiplied by inf (its gradients become inf/nan).

    ``bf16_block``: None keeps the plan's block, else it replaces ``/deepspeed/bf16``. Returns per-step losses,
    whether the weights changed and whether they are finite, the final weights and the DeepSpeed config used.
    """
    import smdistributed.modelparallel.torch as smp
    from smp2ds.engine.core.state import state

    smp.init(config)
    if bf16_block is not None:
        state.plan.deepspeed["bf16"] = dict(bf16_block)  # type: ignore[index]  # the Plan keeps a plain dict
    model = smp.DistributedModel(make_model(5))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    record = poisoned_steps(smp, model, opt, b, steps, inject_at, after=lambda: {
        "finite": all(bool(torch.isfinite(v).all()) for v in model.state_dict().values())})
    used = dict(model.backend.ds_config["bf16"])
    optimizer_class = type(model.backend.ds_optimizer).__name__
    dtype = str(next(model.parameters()).dtype)
    smp.barrier()
    return plain({"record": record, "weights": model.state_dict(), "bf16": used, "optimizer": optimizer_class,
                  "dtype": dtype})
