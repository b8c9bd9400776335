"""Where a rank's main thread is, as the watchdog thread sees it: the stuck-rank half of the watchdog.

A heartbeat proves a rank is alive, not that it progresses: a rank in ``time.sleep`` or one that
called a collective its peers never call keeps beating while the others wait forever. So every
watchdog tick samples its own main thread's Python stack (``sys._current_frames``, no hooks in
the hot path) and publishes a :class:`Position`: the SMP step count, the ``torch.distributed``
call the thread is blocked in (if any), who called it, and the innermost line of user code.

A rank that has sat in the *same* collective call (same frame object) for longer than
``SMP2DS_COMM_TIMEOUT`` is waiting for a peer that will not come; :func:`stall_verdict` then
names the ranks that are not in that collective (the ones behind) and where each one is.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from types import FrameType

from smp2ds.engine.core.state import state

_LIBRARY_PREFIXES = ("torch", "deepspeed", "smp2ds", "smdistributed", "threading", "concurrent", "multiprocessing",
                     "importlib", "runpy", "contextlib", "functools")
_WRAPPER_NAMES = {"wrapper", "_wrapper", "inner", "decorated"}


@dataclass(frozen=True)
class Position:
    """One rank's place in the program at a sampling instant."""

    step: int
    """Completed ``@smp.step`` calls of the current ``DistributedModel`` (0 before the first)."""
    collective: str | None
    """The ``torch.distributed`` function the main thread is inside, e.g. ``all_gather_object``."""
    via: str | None
    """The library function (smp2ds, DeepSpeed) that called the collective."""
    where: str
    """Innermost user-code frame: ``file:line in function``."""

    def describe(self) -> str:
        inside = f"in collective {self.collective}" + (f" (via {self.via})" if self.via else "") \
            if self.collective else "not in a collective"
        return f"{inside} at {self.where}, step {self.step}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Position | None:
        """The position a peer published, or None if it is unreadable (never raises: the watchdog
        thread treats exceptions as a lost store)."""
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError):
            return None


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _is_library(frame: FrameType) -> bool:
    name = _module(frame)
    return any(name == p or name.startswith(p + ".") for p in _LIBRARY_PREFIXES)


def _steps_done() -> int:
    model = state.model
    count = getattr(model, "_count", None) if model is not None else None
    return int(getattr(count, "steps_done", 0) or 0)


def sample(thread_id: int) -> tuple[Position, FrameType | None]:
    """The position of thread ``thread_id`` and the frame of the collective call it is in (or None)."""
    frame = sys._current_frames().get(thread_id)
    stack: list[FrameType] = []
    while frame is not None:
        stack.append(frame)  # innermost first
        frame = frame.f_back
    entry: FrameType | None = None
    entry_index = -1
    for i, f in enumerate(stack):
        if _module(f).startswith("torch.distributed"):
            # keep walking outwards through the contiguous torch.distributed frames: the outermost
            # one is the API call (all_reduce, barrier...), the inner ones are its helpers
            if entry is None or entry_index == i - 1:
                entry, entry_index = f, i
        elif entry is not None:
            break
    collective = via = None
    if entry is not None:
        names = [f.f_code.co_name for f in stack[: entry_index + 1] if _module(f).startswith("torch.distributed")]
        named = [n for n in names if n not in _WRAPPER_NAMES]
        collective = named[-1] if named else names[-1]
        for f in stack[entry_index + 1:]:
            if _module(f).startswith(("smp2ds", "deepspeed")):
                via = f"{_module(f)}.{f.f_code.co_name}"
                break
            if not _is_library(f):
                break
    user = next((f for f in stack if not _is_library(f)), stack[0] if stack else None)
    where = f"{os.path.basename(user.f_code.co_filename)}:{user.f_lineno} in {user.f_code.co_name}" if user else "?"
    return Position(_steps_done(), collective, via, where), entry


def stall_verdict(me: int, waited_s: float, mine: Position, others: dict[int, Position | None],
                  finished: set[int]) -> str:
    """The message naming the ranks behind ``me``, which has waited ``waited_s`` in a collective."""
    behind = []
    for r in sorted(set(others) | finished):
        if r in finished:
            behind.append(f"rank {r} has already finished")
        elif (theirs := others.get(r)) is None:
            behind.append(f"rank {r} (position unknown)")
        elif theirs.collective != mine.collective or theirs.where != mine.where:
            behind.append(f"rank {r} is {theirs.describe()}")
    waiting = f"rank {me} waited {waited_s:.0f} s {mine.describe()}"
    if not behind:
        return f"every rank is stuck in the same collective ({waiting}): the backend is deadlocked"
    return f"rank(s) not progressing: {'; '.join(behind)} ({waiting})"
