"""The watchdog holds the frame of the collective call the main thread is in only while that call runs.

A finished frame keeps its locals (the collective's tensors, and through ``f_back`` the caller's) alive: held for
a whole tick, it kept a finished step's 2 GB ZeRO-1 gradient buffer beside the next one. These are the rules of
letting go; ``test_faults_dist.py`` shows the stall and loss verdicts still work with them.
"""

from __future__ import annotations

import gc
import sys
import weakref

import torch
from torch.distributed import HashStore

from smp2ds.engine.diagnostics import stall
from smp2ds.engine.diagnostics.watchdog import Watchdog


def _watchdog() -> Watchdog:
    return Watchdog(HashStore, rank=0, world_size=1, timeout_s=300.0)


def test_a_finished_call_is_let_go_and_its_tensors_freed():
    wd = _watchdog()

    def collective_like() -> tuple:
        buffer = torch.empty(1000)
        return sys._getframe(), weakref.ref(buffer)

    wd._entry, buffer = collective_like()
    assert buffer() is not None  # the held frame keeps the call's tensor alive
    wd._release_finished_entry()
    gc.collect()
    assert wd._entry is None and buffer() is None


def test_a_running_call_and_a_suspended_generator_are_kept():
    wd = _watchdog()
    wd._entry = sys._getframe()  # executing: this test's own frame
    wd._release_finished_entry()
    assert wd._entry is not None

    def body():
        yield sys._getframe()  # a context manager's body suspended at its yield
        yield "resumed"

    gen = body()
    wd._entry = next(gen)
    wd._release_finished_entry()
    assert wd._entry is not None and next(gen) == "resumed"  # clear() would have closed the generator


def test_a_step_boundary_drops_the_call_and_a_sample_taken_across_it(monkeypatch):
    wd = _watchdog()
    wd._entry = sys._getframe()
    wd.forget_position()
    assert wd._entry is None
    frame = sys._getframe()

    def sample_across_a_boundary(thread_id):
        wd.forget_position()  # the main thread reached a step boundary while the watchdog sampled
        return stall.Position(0, "all_reduce", None, "here"), frame

    monkeypatch.setattr(stall, "sample", sample_across_a_boundary)
    wd._progress()
    assert wd._entry is None


def test_a_call_is_held_only_from_its_second_sighting(monkeypatch):
    """A collective seen at one tick is not held (its tensors are freed by the main thread when it returns); seen
    again at the next tick it is held, and the wait counts from the first sighting."""
    wd = _watchdog()
    frame = sys._getframe()
    monkeypatch.setattr(stall, "sample", lambda thread_id: (stall.Position(0, "all_reduce", None, "here"), frame))
    wd._progress()
    first = wd._entry_since
    assert wd._entry is None and wd._sighted == (id(frame), frame.f_code)
    wd._progress()
    assert wd._entry is frame and wd._entry_since == first
    wd._entry = None  # the call returned and was let go: a frame at the same address later is a new call
    wd._sighted = None
    wd._progress()
    assert wd._entry is None and wd._entry_since > first
