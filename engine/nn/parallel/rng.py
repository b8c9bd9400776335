"""The tensor-parallel random stream (SMP: ``tensor_parallel_seed``, ``smp.state.rng_manager``).

Ranks of one tensor-parallel group must draw identical dropout masks inside a region (their
activations there are replicated), whatever seeds the script gave each rank. Regions therefore
run on a separate CPU (and CUDA) generator state seeded from ``tensor_parallel_seed``, identical
on every member, that advances only inside regions; the script's own stream is restored after.
Fresh weights of distributed modules are drawn from ``init_generator``: seed
``tensor_parallel_seed`` plus a counter of the stream's initialisations, so every rank (and every tensor-parallel
degree) draws the same full tensor. A replaced Hugging Face model's weights that transformers neither initialised
nor loaded are drawn from ``fresh_generator``, a second counter offset by :data:`FRESH_STREAM`.

A stream belongs to a tensor-parallel group (:class:`~smp2ds.engine.nn.parallel.group.TPGroup` ``.rng``): the
group ``smp.init`` builds carries the Plan's seed, and ``smp.reset()`` starts it afresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

FRESH_STREAM = 1 << 32
"""Offset of the fresh-weight seeds from ``tensor_parallel_seed`` (away from the distributed modules'
own ``seed + n`` streams)."""


class RngManager:
    """The group's region stream and the counters of distributed-module initialisations and replaced models."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._inits = 0
        self._fresh_models = 0
        # the state torch.manual_seed(seed) gives the CPU generator, without touching the process's own
        self._cpu_state = torch.Generator().manual_seed(self.seed).get_state()
        self._cuda_state: torch.Tensor | None = None

    @contextlib.contextmanager
    def region_stream(self) -> Iterator[None]:
        """Run the body on this stream (CPU, and CUDA where initialised); the caller's stream is restored after."""
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

    def fresh_generator(self) -> torch.Generator:
        """A generator for the next replaced model's fresh weights (same on every rank; each model its own)."""
        gen = torch.Generator().manual_seed(self.seed + FRESH_STREAM + self._fresh_models)
        self._fresh_models += 1
        return gen
