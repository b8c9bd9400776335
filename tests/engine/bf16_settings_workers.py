"""Rank bodies for tests/engine/test_bf16_settings_dist.py: one bf16 run with the bf16 block the plan writes or
with the block smp2ds wrote before (``{"enabled": true}``, DeepSpeed's defaults), an inf optionally injected.

Only ``plan.deepspeed["bf16"]`` is replaced, before the model exists: the engine builds its DeepSpeed config
from the plan, so the two runs differ in exactly those switches.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from tests.engine.train_workers import make_model, plain, rank_batch

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

    @smp.step(non_split_inputs=["poison"])
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss * poison)
        return loss

    record = []
    for step in range(steps):
        x, y = rank_batch(step, smp.dp_size(), b, smp.dp_rank())
        poison = torch.tensor(math.inf if (step == inject_at and smp.rank() == 1) else 1.0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        loss = train_step(model, x, y, poison).reduce_mean()
        opt.step()
        after = model.state_dict()
        record.append({"loss": loss.item(),
                       "changed": not all(torch.equal(before[k], v) for k, v in after.items()),
                       "finite": all(bool(torch.isfinite(v).all()) for v in after.values())})
    used = dict(model.backend.ds_config["bf16"])
    optimizer_class = type(model.backend.ds_optimizer).__name__
    dtype = str(next(model.parameters()).dtype)
    smp.barrier()
    return plain({"record": record, "weights": model.state_dict(), "bf16": used, "optimizer": optimizer_class,
                  "dtype": dtype})
