"""Rank bodies for loading checkpoints without running their code (see ``test_safe_resume_dist``).

``Hostile`` pickles as a call of ``open(marker, "w")``: unpickling it with ``weights_only=False`` creates the
marker file, which must never appear unless the script trusts the checkpoint.
"""

from __future__ import annotations

import argparse
import fractions
import os
from typing import Any

import numpy as np
import torch


class Hostile:
    """Unpickling this creates ``path`` (what code hidden in a checkpoint could do)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _message(fn: Any) -> str | None:
    from smdistributed.modelparallel.torch.exceptions import SMPCheckpointError

    try:
        fn()
    except SMPCheckpointError as err:
        return str(err)
    return None


def run_safe_loading(root: str, shard_optimizer_state: bool) -> dict:
    """Save and resume a checkpoint whose user_content holds what SMP scripts put there (no switch needed), then
    try hostile files through every loading path; report what came back and what each refusal said."""
    import transformers

    import smdistributed.modelparallel.torch as smp
    from tests.engine.workers.train_workers import plain

    smp.init({"ddp": True, "shard_optimizer_state": shard_optimizer_state})
    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    step(model, torch.ones(2, 4))
    opt.step()
    scheduler = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=3)
    content = {"args": argparse.Namespace(lr=0.1, model="tiny"), "config": transformers.GPT2Config(n_layer=2),
               "loss": np.float64(1.5), "tokens": np.arange(3), "scheduler": scheduler.state_dict(), "step": 1}
    smp.save_checkpoint(root, "good", partial=True, model=model, optimizer=opt, user_content=content)
    smp.save_checkpoint(root, "good_full.pt", partial=False, model=model, user_content=content)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    smp.reset()
    model = smp.DistributedModel(_model())
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    back = smp.resume_from_checkpoint(root, tag="good", partial=True)
    full_back = smp.resume_from_checkpoint(root, tag="good_full.pt", partial=False)
    step(model, torch.ones(2, 4))  # the model's state lands at its first step
    out: dict[str, Any] = {"content": back, "full_content": full_back, "saved": saved}

    marker = os.path.join(root, f"pwned-{smp.rank()}")
    evil = os.path.join(root, f"evil-{smp.rank()}.pt")
    torch.save({"weight": Hostile(marker)}, evil)
    bad_partial = os.path.join(root, "bad_partial")
    if smp.rank() == 0:  # a partial checkpoint as SMP wrote them (no manifest), its model file hostile
        os.makedirs(bad_partial, exist_ok=True)
        torch.save({"0.weight": Hostile(marker)}, os.path.join(bad_partial, "model_0_0.pt"))
    smp.barrier()
    smp.reset()
    model = smp.DistributedModel(_model())
    out["refused"] = {
        "full": _message(lambda: smp.resume_from_checkpoint(root, tag=os.path.basename(evil), partial=False)),
        "partial": _message(lambda: smp.resume_from_checkpoint(root, tag="bad", partial=True,
                                                               load_optimizer=False)),
        "smp.load": _message(lambda: smp.load(evil, partial=False)),
        "smp.load weights_only=True": _message(lambda: smp.load(evil, partial=False, weights_only=True)),
    }
    out["marker_after_refusals"] = os.path.exists(marker)
    fraction = os.path.join(root, f"fraction-{smp.rank()}.pt")
    torch.save({"ratio": fractions.Fraction(1, 3)}, fraction)  # harmless, but not a type smp2ds allows by name
    out["fraction_refused"] = _message(lambda: smp.load(fraction, partial=False))
    out["fraction_trusted"] = smp.load(fraction, partial=False, weights_only=False)
    os.environ["SMP2DS_TRUST_CHECKPOINTS"] = "1"
    try:
        out["fraction_by_environment"] = smp.load(fraction, partial=False)
    finally:
        del os.environ["SMP2DS_TRUST_CHECKPOINTS"]
    smp.barrier()
    return plain(out)
