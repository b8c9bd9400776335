"""How failures are reported: once, clearly, and without leaving the other ranks waiting.

* Errors every rank shares (an invalid configuration) are marked with the one rank that prints
  them; the others exit quietly with the same exception, so the log shows one message instead
  of N interleaved tracebacks.
* Any other uncaught exception is published to the peers through the watchdog (so they stop at
  once, naming this rank) before the normal traceback is printed — except a communication
  failure, which is usually the *symptom* of another rank dying: then this rank waits for the
  watchdog's verdict naming the lost rank (bounded by ``SMP2DS_COMM_TIMEOUT``).
"""

from __future__ import annotations

import sys
from types import TracebackType

from smp2ds.engine.core.state import state

_REPORT_ATTR = "smp2ds_report_rank"
_COMM_WORDS = ("gloo", "nccl", "connection", "socket", "peer", "timed out", "timeout", "broken pipe")
_installed = False
_hook_rank = 0
"""The rank the installed hook reports as (:func:`install`)."""
_previous_hook = sys.excepthook


def mark_reported_once(exc: BaseException, report_rank: int, note: str | None = None) -> None:
    """Only ``report_rank`` prints ``exc`` (plus ``note``) if it ends the process."""
    setattr(exc, _REPORT_ATTR, report_rank)
    exc.smp2ds_note = note


def looks_like_comm_failure(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, (RuntimeError, ConnectionError, OSError)) and any(w in text for w in _COMM_WORDS)


def _hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    rank = _hook_rank
    report_rank = getattr(exc, _REPORT_ATTR, None)
    wd = state.watchdog
    if report_rank is not None:
        if wd is not None:
            wd.halt()
        if rank == report_rank:
            note = getattr(exc, "smp2ds_note", None)
            sys.stderr.write(f"smp2ds: {exc}\n" + (f"  ({note})\n" if note else ""))
            sys.stderr.flush()
        return
    if wd is not None and not issubclass(exc_type, KeyboardInterrupt):
        if looks_like_comm_failure(exc):
            # The watchdog thread ends the process itself once it knows which rank was lost.
            wd.wait_for_verdict(wd.timeout_s + 5 * wd.interval_s)
        else:
            wd.halt()
            wd.record_failure(f"rank {rank} failed: {exc_type.__name__}: {exc}".splitlines()[0])
    _previous_hook(exc_type, exc, tb)


def install(rank: int) -> None:
    """Install the excepthook once per process; ``rank`` is the rank it reports as (a config error ends
    ``smp.init`` before the runtime that knows the rank exists)."""
    global _installed, _previous_hook, _hook_rank
    _hook_rank = rank
    if _installed:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _hook
    _installed = True

