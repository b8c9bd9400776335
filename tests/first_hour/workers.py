"""Rank bodies for tests/first_hour/test_mistakes_dist.py: each makes one likely first-hour mistake.

Each returns ``(exception class name, message)`` of what the mistake raised, or ``("none", "")``, so the
test can hold the message to the bar: it names the cause and the fix in at most three lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _caught(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test judges whatever the mistake raised
        return type(err).__name__, str(err)
    return "none", ""


def _smp() -> Any:
    import smdistributed.modelparallel.torch as smp

    return smp


def no_parameters() -> tuple[str, str]:
    """2 ranks, no SM_HP_MP_PARAMETERS and no dict: smp.init() alone."""
    return _caught(_smp().init)


def optimizer_from_unwrapped_model() -> tuple[str, str]:
    smp = _smp()
    smp.init({"ddp": True})
    raw = torch.nn.Linear(4, 4)
    smp.DistributedModel(raw)
    plain = torch.nn.Linear(4, 4)  # the script meant the wrapped model's parameters
    return _caught(lambda: smp.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1)))


def backward_outside_step() -> tuple[str, str]:
    smp = _smp()
    smp.init({"ddp": True})
    model = smp.DistributedModel(torch.nn.Linear(4, 1))
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return _caught(lambda: model.backward(model(torch.randn(2, 4)).sum()))


class Branchy(torch.nn.Module):
    """Python control flow on a tensor: torch.fx cannot trace it, so a pipeline cannot cut it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        return self.b(h)


def pipeline_over_untraceable_module() -> tuple[str, str]:
    smp = _smp()
    smp.init({"partitions": 2, "ddp": True})
    return _caught(lambda: smp.DistributedModel(Branchy()))


def tp_degree_not_dividing_heads() -> tuple[str, str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    smp = _smp()
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    with smp.model_creation(tensor_parallelism=True):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=24, n_head=3, vocab_size=64, n_positions=16,
                                           bos_token_id=0, eos_token_id=0))
    return _caught(lambda: smp.DistributedModel(model))


def _mlp_job(smp: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1))

    @smp.step
    def step(model: Any, x: torch.Tensor) -> torch.Tensor:
        loss = model(x).sum()
        model.backward(loss)
        return loss

    step(model, torch.randn(4, 4))
    optimizer.step()
    return model, optimizer


def save_sharded_checkpoint(path: str) -> tuple[str, str]:
    """2 ranks, optimizer state sharded (ZeRO-1): a partial checkpoint."""
    smp = _smp()
    smp.init({"ddp": True, "shard_optimizer_state": True})
    model, optimizer = _mlp_job(smp)
    smp.save_checkpoint(path, tag="s1", partial=True, model=model, optimizer=optimizer)
    return "none", ""


def resume_at_another_layout(path: str) -> tuple[str, str]:
    """1 rank resumes what 2 ranks saved."""
    smp = _smp()
    smp.init({"ddp": True, "shard_optimizer_state": True})
    return _caught(lambda: smp.resume_from_checkpoint(path, partial=True))
