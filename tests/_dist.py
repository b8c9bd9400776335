"""The one multi-rank test harness: real processes, gloo, file rendezvous, hard timeout.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` spawned Python processes, each
with the environment a ``torchrun`` worker would see (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) plus ``SMP2DS_INIT_METHOD=file://...`` so process groups
rendezvous through a file instead of a port. Each process calls ``fn(*args)`` and the list of
return values (indexed by rank) comes back. A failing rank re-raises here as
``RankFailed`` naming the rank and carrying its traceback; when the timeout expires every
worker of this call is killed and ``RankTimeout`` names the ranks that had not finished.

``fn`` must be a module-level function (it is pickled by name). Return values must pickle;
return CPU tensors or plain Python values.

Processes come from a ``forkserver`` that imported torch and DeepSpeed once (`PRELOAD`): each
rank is a fresh fork of that server, so it starts clean but skips the ~2 s those imports cost a
spawned interpreter. Nothing whose import reads the SageMaker environment (transformers'
``modeling_utils``, ``trainer``; smdistributed) is preloaded: those stay per-rank imports, in the
environment the test gives its ranks. ``SMP2DS_TEST_START=spawn`` starts plain spawned
interpreters instead.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

DEFAULT_TIMEOUT_S = float(os.environ.get("SMP2DS_TEST_TIMEOUT", "240"))

BASE_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "DS_ACCELERATOR": "cpu",
    "GLOO_SOCKET_IFNAME": "lo",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONHASHSEED": "0",
}


# Imported once by the fork server. Only modules whose import does not depend on the ranks'
# environment beyond BASE_ENV (which the server starts with).
PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3",
           "deepspeed.runtime.pipe.engine", "deepspeed.runtime.zero.stage_1_and_2"]
_START_METHOD = os.environ.get("SMP2DS_TEST_START", "forkserver")
_SESSION_ENV = dict(os.environ)
"""The environment when the harness was imported (test collection), before any test changed it."""


class RankFailed(RuntimeError):
    """A worker raised; the message names the rank and includes its traceback."""


class RankTimeout(RuntimeError):
    """Workers did not finish in time; the message names the ranks still running."""


def _worker(rank: int, fn: Callable[..., Any], args: tuple, env: dict[str, str], results: Any) -> None:
    os.environ.update(env)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank % int(env["LOCAL_WORLD_SIZE"]))
    try:
        value = fn(*args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
    ranks_per_node: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes and return their results by rank."""
    ctx = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="smp2ds-dist-") as tmp:
        full_env = dict(BASE_ENV)
        full_env.update(
            {
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(ranks_per_node or world_size),
                "SMP2DS_INIT_METHOD": f"file://{tmp}/rendezvous",
                "SMP2DS_TEST_TMPDIR": tmp,
            }
        )
        full_env.update(env or {})
        results = ctx.Queue()
        # Spawned interpreters (and the fork server, started on first use) must import the test
        # module exactly as pytest did, and the server must preload in the ranks' base environment:
        # the session's, never what the test that happens to start it has monkeypatched (the server
        # lives on, and every later rank would inherit that).
        with _environ_exactly({**_SESSION_ENV, **BASE_ENV, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}):
            procs = [ctx.Process(target=_worker, args=(r, fn, args, full_env, results)) for r in range(world_size)]
            for p in procs:
                p.start()
        return _collect(procs, results, world_size, timeout_s)


@contextlib.contextmanager
def _environ_exactly(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is exactly ``values`` for the block, then what it was."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _collect(procs: list[Any], results: Any, world_size: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pending = sorted(set(range(world_size)) - set(values) - set(failures))
                detail = "".join(f"\n--- rank {r} failed first:\n{failures[r]}" for r in sorted(failures))
                raise RankTimeout(f"ranks {pending} did not finish within {timeout_s:.0f}s{detail}")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                dead = [r for r in dead if r not in values and r not in failures]
                for r in dead:
                    failures[r] = f"process exited with code {procs[r].exitcode} without reporting"
                if failures and all(p.exitcode is not None for p in procs):
                    break
                continue
            (values if ok else failures)[rank] = value
            if failures and not ok:
                # Give the other ranks a moment to report, then stop waiting on them.
                deadline = min(deadline, time.monotonic() + 15)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    if failures:
        first = min(failures)
        text = "".join(f"\n--- rank {r}:\n{failures[r]}" for r in sorted(failures))
        raise RankFailed(f"rank {first} failed ({len(failures)} of {world_size} ranks failed):{text}")
    return [values[r] for r in range(world_size)]
