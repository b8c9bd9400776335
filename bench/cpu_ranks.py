"""Starting a benchmark's ranks on this machine: spawned processes, gloo on CPU, a file rendezvous, each rank's
result a JSON file (the pattern the older benches spell out themselves)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def enter_rank(rank: int, world: int, rendezvous: str) -> None:
    """The environment a launcher gives rank ``rank`` of ``world`` (CPU, one thread, file rendezvous)."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "SMP2DS_INIT_METHOD": rendezvous, "OMP_NUM_THREADS": "1",
                       "DS_ACCELERATOR": "cpu"})


def _entry(rank: int, fn: Callable[..., dict], world: int, rendezvous: str, out: str, args: tuple) -> None:
    enter_rank(rank, world, rendezvous)
    result = fn(rank, *args)
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(result, handle)


def run(fn: Callable[..., dict], world: int, *args: Any) -> list[dict]:
    """``fn(rank, *args)`` on ``world`` spawned ranks (``fn`` at module level); their JSON results by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.start_processes(_entry, args=(fn, world, f"file://{tmp}/rdv", out, args), nprocs=world,
                           start_method="spawn")
        results = []
        for r in range(world):
            with open(f"{out}.{r}") as handle:
                results.append(json.load(handle))
        return results
