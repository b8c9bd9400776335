"""Rank bodies for the ``flash_attention=True`` tests at tensor_parallel_degree 2.

Each phase trains a freshly replaced Hugging Face model through :func:`tests.engine.workers.transformer_workers._train`
(``phase["settings"]`` reaches ``smp.model_creation``), while a :class:`~torch.overrides.TorchFunctionMode`
counts the calls of ``torch.nn.functional.scaled_dot_product_attention``: the tests check that the flash
path really ran (and that the eager phases never called it), so equal results cannot come from one path
twice.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tests.engine.workers import transformer_workers as tw
from tests.engine.workers.train_workers import plain


class SdpaCalls(TorchFunctionMode):
    """Counts ``scaled_dot_product_attention`` calls made while active (every call runs unchanged)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def run(config: dict, phases: list[dict], b: int) -> list[dict]:
    """Initialise SMP once; per phase a fresh model (``smp.reset()``: the tensor-parallel stream restarts
    from ``tensor_parallel_seed``), its results and the number of SDPA calls it made."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    results = []
    for phase in phases:
        smp.reset()
        with SdpaCalls() as counter:
            out = tw._train(smp, phase, b)
        results.append({**out, "sdpa_calls": counter.calls,
                        "optimize": smp.state.plan.engine["tensor_parallel"]["optimize"]})
    smp.barrier()
    return plain(results)
