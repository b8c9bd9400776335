"""The tensor-parallel random stream (SMP: ``tensor_parallel_seed``, ``smp.state.rng_manager``).

Ranks of one tensor-parallel group must draw identical dropout masks inside a region (their
activations there are replicated), whatever seeds the script gave each rank. Regions therefore
run on a separate CPU (and CUDA) generator state seeded from ``tensor_parallel_seed``, identical
on every member, that advances only inside regions; the script's own stream is restored after.
Fresh weights of distributed modules are drawn from ``init_generator``: seed
``tensor_parallel_seed`` plus a per-process counter, so every rank (and every tensor-parallel
degree) draws the same full tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from smp2ds.engine.core.state import state
from smp2ds.translator.tensor_parallel import TensorParallelSettings


class RngManager:
    """The group's region stream and the counter of distributed-module initialisations."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._inits = 0
        saved = torch.get_rng_state()
        torch.manual_seed(self.seed)
        self._cpu_state = torch.get_rng_state()
        torch.set_rng_state(saved)
        self._cuda_state = None

    @contextlib.contextmanager
    def region_stream(self) -> Iterator[None]:
        outer_cpu = torch.get_rng_state()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        outer_cuda = torch.cuda.get_rng_state() if cuda else None
        torch.set_rng_state(self._cpu_state)
        if cuda:
            if self._cuda_state is None:
                torch.cuda.manual_seed(self.seed)
            else:
                torch.cuda.set_rng_state(self._cuda_state)
        try:
            yield
        finally:
            self._cpu_state = torch.get_rng_state()
            torch.set_rng_state(outer_cpu)
            if cuda:
                self._cuda_state = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(outer_cuda)

    def init_generator(self) -> torch.Generator:
        """A generator for the next distributed module's fresh weights (same on every rank)."""
        gen = torch.Generator().manual_seed(self.seed + self._inits)
        self._inits += 1
        return gen


def manager() -> RngManager:
    """``smp.state.rng_manager``, created on first use from the Plan's seed."""
    if state.rng_manager is None:
        seed = state.plan.engine_settings.tensor_parallel.seed if state.initialized else TensorParallelSettings.seed
        state.rng_manager = RngManager(seed)
    return state.rng_manager


@contextlib.contextmanager
def region_stream() -> Iterator[None]:
    """Run the body on the tensor-parallel group's random stream."""
    with manager().region_stream():
        yield
