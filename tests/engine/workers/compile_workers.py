"""Rank body for tests/engine/api/test_compile_dist.py: a few steps of a small model, eager or with
``SMP2DS_COMPILE=1`` (set by the test in the ranks' environment)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.engine.workers.train_workers import make_model, plain, rank_batch


def run_steps(config: dict, b: int, steps: int) -> dict:
    """Losses of ``steps`` Adam steps, the final weights, and whether DeepSpeed's engine is compiled."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    model = smp.DistributedModel(make_model(11))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(steps):
        x, y = rank_batch(step, smp.dp_size(), b, smp.dp_rank())
        opt.zero_grad()
        losses.append(train_step(model, x, y).reduce_mean().item())
        opt.step()
    compiled = bool(model.backend.engine.is_compiled)
    smp.barrier()
    return plain({"losses": losses, "weights": model.state_dict(), "compiled": compiled})


def init_only(config: dict) -> None:
    """``smp.init`` alone: the place a refused setting must fail."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
