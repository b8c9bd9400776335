"""Bounded failure detection: when a rank dies or hangs, the others stop instead of waiting.

A collective whose peer has vanished can block until the process-group timeout (30 minutes by
default) — or forever if the peer is alive but stuck. Each rank therefore runs a daemon thread
that talks to the rendezvous store on its own client connection:

* it bumps a heartbeat counter ``hb/<rank>`` every ``interval`` seconds;
* it watches one peer, the next rank in ring order that has not finished (``done/<rank>``), so the
  store sees O(world) traffic rather than O(world^2);
* when that peer's counter has not moved for ``timeout`` seconds it records the verdict in the
  ``abort`` key (first writer wins), and every rank that reads ``abort`` prints one line naming
  the lost rank and exits with :data:`RANK_LOST_EXIT_CODE`;
* a rank that fails with a Python exception records ``rank N failed: ...`` at once (fast path);
* it publishes where its main thread is (:mod:`stall`); a rank that has waited inside one
  collective call for ``timeout`` seconds records a verdict naming the ranks that are not in it
  (alive but stuck: sleeping, or in a collective the others never call) and where they are —
  unless a peer's heartbeat did not move in the second half of that wait: then that peer is lost;
* if the store itself becomes unreachable, its host (rank 0, unless torchrun's agent hosts it)
  is the lost rank.

The timeout is ``SMP2DS_COMM_TIMEOUT`` seconds (default 300); ``0`` disables the watchdog.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from smp2ds.engine.core import comm, launch_env
from smp2ds.engine.diagnostics import stall

RANK_LOST_EXIT_CODE = 75
RELEASE_POLL_S = 0.02
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
"""How often the thread checks whether the collective call it holds has returned (see _release_finished_entry)."""
DEFAULT_TIMEOUT_S = launch_env.COMM_TIMEOUT_DEFAULT_S


def timeout_from_env() -> float:
    """``SMP2DS_COMM_TIMEOUT`` in seconds (0 disables); a bad value is an error naming the variable."""
    return launch_env.comm_timeout_s()


class Watchdog:
    """Heartbeat thread for one rank; see the module docstring for the protocol."""

    def __init__(self, open_store: Callable[[], comm.Store], rank: int, world_size: int, timeout_s: float,
                 store_host: str | None = None):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, max(0.1, timeout_s / 5))
        self._store = open_store()
        self._store_host = store_host
        self._stop = threading.Event()
        self._verdict: str | None = None
        self._verdict_ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"smp2ds-watchdog-{rank}", daemon=True)
        self._seen: dict[int, tuple[int, float]] = {}
        self._main_thread = threading.get_ident()  # the thread running smp.init: the training loop
        self._entry: Any = None  # the frame of a collective call waited in since the previous tick
        self._sighted: tuple[int, Any] | None = None  # (id, code) of the call first seen at the last tick, not held
        self._entry_since = 0.0
        self._forgotten = 0  # bumped by forget_position (main thread); a sample taken across a bump is dropped
        self._peer_beats: dict[int, int] = {}  # each peer's heartbeat count at the first look of a long wait
        self._peer_beats_since: float | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> Watchdog:
        self._store.add(f"hb/{self.rank}", 1)
        self._thread.start()
        return self

    def stop(self, wait_for_peers: bool = False, before_done: Callable[[], None] | None = None) -> None:
        """Finish: stop heartbeating, run ``before_done`` (e.g. destroy the process group), mark this
        rank done; the store host then waits for the others so its store outlives their last use."""
        self.halt()
        if before_done is not None and not wait_for_peers:
            before_done()
        try:
            self._store.set(f"done/{self.rank}", "1")
            if wait_for_peers:
                self._wait_for_peers()
        except Exception:  # noqa: BLE001 - shutting down; the store may already be gone
            pass
        if before_done is not None and wait_for_peers:
            before_done()

    def _release_finished_entry(self) -> None:
        """Let go of the held collective frame as soon as its call has returned.

        The frame is held so that a wait is known to be one call (a new call may reuse a finished frame's
        memory, and so its id), but a finished frame keeps its locals, and its callers' through ``f_back``,
        alive: the tensors of that collective and of the layer around it. ``frame.clear()`` refuses a frame that
        is still executing and frees a finished one's locals, so polling it bounds the extra life of those
        tensors to ``RELEASE_POLL_S`` instead of a whole tick (measured: up to 20 % above a step's peak)."""
        entry = self._entry
        if entry is None or entry.f_code.co_flags & _SUSPENDABLE:
            return  # a generator's frame (a context manager's body) suspended at a yield would be closed by clear()
        try:
            entry.clear()
        except RuntimeError:  # still executing: the wait goes on
            return
        if self._entry is entry:
            self._entry = self._sighted = None  # a new frame at the same address is a new call

    def forget_position(self) -> None:
        """Drop the collective call last seen on the main thread; the main thread calls this between steps, when
        it is in none. The held frame keeps that call's locals alive until the next tick: DeepSpeed's gradient
        reduction frames hold views of its bucket, so a finished step's 2 GB ZeRO-1 buffer outlived it while the
        next step allocated its own (seen at random, by the memory estimate's measurement)."""
        self._forgotten += 1
        self._entry = self._sighted = None

    def halt(self) -> None:
        """Stop heartbeating without marking this rank finished."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)  # a tick is milliseconds; a stuck store call times out

    def _wait_for_peers(self) -> None:
        # The store host must outlive every client, or their last heartbeats fail and they
        # would report it as lost. Wait while peers are finishing or still alive.
        deadline: dict[int, float] = {}
        pending = [r for r in range(self.world_size) if r != self.rank]
        while pending:
            now = time.monotonic()
            still = []
            for r in pending:
                if self._store.check([f"done/{r}"]):
                    continue
                count = int(self._store.add(f"hb/{r}", 0))
                last = self._seen.get(r)
                if last is None or last[0] != count:
                    self._seen[r] = (count, now)
                    deadline[r] = now + self.timeout_s
                if now < deadline.get(r, now + self.timeout_s):
                    still.append(r)
            pending = still
            if pending:
                time.sleep(self.interval_s)

    # ---- failure reporting -----------------------------------------------------------------
    def record_failure(self, message: str) -> None:
        """Publish this rank's own failure so the others stop at once."""
        try:
            self._store.compare_set("abort", "", message)
        except Exception:  # noqa: BLE001 - best effort while dying
            pass

    def wait_for_verdict(self, timeout_s: float) -> str | None:
        """Wait until some rank's loss is known (used when a collective failed on this rank)."""
        self._verdict_ready.wait(timeout_s)
        return self._verdict

    # ---- the thread --------------------------------------------------------------------------
    def _target(self) -> int | None:
        for step in range(1, self.world_size):
            peer = (self.rank + step) % self.world_size
            if not self._store.check([f"done/{peer}"]):
                return peer
        return None

    def _run(self) -> None:
        next_tick = time.monotonic() + self.interval_s
        while not self._stop.wait(min(RELEASE_POLL_S, max(0.0, next_tick - time.monotonic()))):
            self._release_finished_entry()
            if time.monotonic() < next_tick:
                continue
            next_tick = time.monotonic() + self.interval_s
            try:
                verdict = self._tick()
            except Exception as exc:  # noqa: BLE001 - the store is gone: its host died
                if self._stop.is_set():
                    return
                host = self._store_host or "the rendezvous store host"
                verdict = f"lost the rendezvous store ({host}): {type(exc).__name__}: {exc}".strip()
            if verdict:
                self._abort(verdict)
                return

    def _tick(self) -> str | None:
        self._store.add(f"hb/{self.rank}", 1)
        if self._store.check(["abort"]):
            return self._store.get("abort").decode()
        stalled = self._progress()
        if stalled:
            return stalled
        peer = self._target()
        if peer is None:
            return None
        now = time.monotonic()
        count = int(self._store.add(f"hb/{peer}", 0))
        last = self._seen.get(peer)
        if last is None or last[0] != count:
            self._seen[peer] = (count, now)
            return None
        if now - last[1] > self.timeout_s:
            message = f"rank {peer} lost: no heartbeat for {self.timeout_s:g} s (noticed by rank {self.rank})"
            self._store.compare_set("abort", "", message)
            return self._store.get("abort").decode()
        return None

    def _progress(self) -> str | None:
        """Publish where the main thread is; a verdict when it has waited in one collective too long."""
        forgotten = self._forgotten
        position, entry = stall.sample(self._main_thread)
        # A call seen at one tick only is not held: the frame is kept (so that its identity stays unique) from the
        # second tick that finds the same frame, i.e. for calls that already wait over a tick. Held frames are let
        # go by this thread when their call returns (_release_finished_entry), which frees their locals here: a
        # short call's tensors (a ZeRO-1 step's 2 GB gradient buffer) are never the watchdog's to free, so they go
        # when the main thread drops them, and a per-thread allocator count (PyTorch's profiler) sees the free.
        key = None if entry is None else (id(entry), entry.f_code)
        held = entry is not None and entry is self._entry
        if not held and (key is None or key != self._sighted):
            entry = None  # not to be held: let go now, not after the store's round trip below
        self._store.set(f"pos/{self.rank}", position.to_json())
        now = time.monotonic()
        if forgotten != self._forgotten:
            entry, key, held = None, None, False  # sampled before a step boundary: that call may have finished
        if not held:
            if entry is not None:
                self._entry = entry  # the second sighting: the wait started at the first
            else:
                self._sighted, self._entry, self._entry_since = key, None, now
                self._peer_beats, self._peer_beats_since = {}, None
            return None
        waited = now - self._entry_since
        if waited <= self.timeout_s / 2:
            return None
        if self._peer_beats_since is None:  # halfway: first look at every peer's heartbeat
            self._peer_beats_since = now
            self._peer_beats = {r: self._beats_of(r) for r in self._live_peers()}
            return None
        if waited <= self.timeout_s or now - self._peer_beats_since < self.timeout_s / 2:
            return None
        silent = self._silent_peers()
        if silent:
            # a dead peer, not a stuck one: its heartbeat stopped while this rank waited for it
            message = (f"rank {silent[0]} lost: no heartbeat for {now - self._peer_beats_since:.0f} s "
                       f"(noticed by rank {self.rank})")
            self._store.compare_set("abort", "", message)
            return self._store.get("abort").decode()
        others: dict[int, stall.Position | None] = {}
        finished: set[int] = set()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            if self._store.check([f"done/{r}"]):
                finished.add(r)
            else:
                others[r] = stall.Position.from_json(self._store.get(f"pos/{r}").decode()) \
                    if self._store.check([f"pos/{r}"]) else None  # from_json never raises: see stall.py
        message = stall.stall_verdict(self.rank, waited, position, others, finished)
        self._store.compare_set("abort", "", message)
        return self._store.get("abort").decode()

    def _silent_peers(self) -> list[int]:
        """Peers whose heartbeat has not moved since the first look, taken halfway through this
        rank's wait in one collective and at least ``timeout / 2`` ago.

        A rank that waits in a collective for a peer that was killed must name it as lost, not as
        "not progressing": the ring neighbour's heartbeat check may be a tick behind this one. A long
        wait reads every peer's counter twice (the first look, then here), a short one never.
        """
        return [r for r in self._live_peers() if r in self._peer_beats and self._beats_of(r) == self._peer_beats[r]]

    def _live_peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank and not self._store.check([f"done/{r}"])]

    def _beats_of(self, r: int) -> int:
        return int(self._store.add(f"hb/{r}", 0))

    def _abort(self, verdict: str) -> None:
        self._verdict = verdict
        self._verdict_ready.set()
        sys.stderr.write(
            f"smp2ds: rank {self.rank} stops because {verdict} "
            f"(SMP2DS_COMM_TIMEOUT={self.timeout_s:g}s)\n"
        )
        sys.stderr.flush()
        # The main thread may be blocked inside a C++ collective that will never return, so
        # raising there is impossible; leave the process directly.
        os._exit(RANK_LOST_EXIT_CODE)
