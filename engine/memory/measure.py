"""Measuring a real step's peak, two ways that share no code: the bytes of live tensor storages, counted as they are
made and freed (`LiveTensorBytes`), and PyTorch's CPU allocator's own running total read from the profiler
(`AllocatorPeak`).

`LiveTensorBytes` is a ``TorchDispatchMode``: every operator's output storage is counted once when first
seen and uncounted when Python frees it (a weak reference's callback), and the peak of the running sum is
kept. It installs no module or gradient hooks, so it keeps nothing alive itself (PyTorch's ``MemTracker``
holds freed tensors in reference cycles until the garbage collector runs, which doubled a 2 GB DeepSpeed
bucket at random). Storages resized in place (``UntypedStorage.resize_``) are counted at their first size;
DeepSpeed 0.19.8's ZeRO-3 resizes none (it frees a gathered parameter by replacing ``param.data`` with an empty
tensor), so sharded data parallelism is counted exactly too.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages made inside the block; ``peak`` is the largest sum seen."""

    def __init__(self) -> None:
        super().__init__()
        # Storages are also freed on other threads (collective work handles, autograd): the running sum is
        # updated under a lock, or a free interleaved with a count is lost and the figure drifts upwards.
        self._lock = threading.RLock()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._home = threading.get_ident()
        self.freed_elsewhere: dict[str, int] = {}
        """Bytes freed on threads other than the one that made the counter, by thread name (gloo's workers are
        ``Dummy-N``): frees a per-thread allocator count (PyTorch's profiler) does not see."""

    def _on_free(self, key: int, _ref: weakref.ref) -> None:
        self._freed(key)

    def _freed(self, key: int) -> None:
        with self._lock:
            size = self._sizes.pop(key, 0)
            self.live -= size
            self._refs.pop(key, None)
            if size and threading.get_ident() != self._home:
                name = threading.current_thread().name
                self.freed_elsewhere[name] = self.freed_elsewhere.get(name, 0) + size

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        with self._lock:
            if key in self._sizes:
                return
            size = storage.nbytes()
            self._sizes[key] = size
            self._refs[key] = weakref.ref(storage, functools.partial(self._on_free, key))
            self.live += size
            self.peak = max(self.peak, self.live)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._count(item)
        return out


class AllocatorPeak:
    """The peak of PyTorch's CPU allocator's running total inside the block, read from ``torch.profiler``'s memory
    events (``profile_memory=True``): each allocation event carries the allocator's total after it.

    The allocator counts what it hands out and frees only on threads the profiler records (the one that entered the
    block, and autograd's): a block freed on another thread is never subtracted, and the total drifts up. Such a
    free is still visible afterwards: the allocator cannot hand out an address that is in use, so an allocation at
    the address of a block whose free was not seen proves that block was freed first. ``peak`` is the allocator's
    figure as recorded; ``peak_corrected`` subtracts each such block from the point its address was handed out
    again; ``unseen_frees`` counts them. A free on another thread whose address is never reused stays counted, so
    ``peak_corrected`` is still an upper bound.
    """

    def __init__(self) -> None:
        self.peak = 0
        self.peak_corrected = 0
        self.unseen_frees = 0
        self._profile: Any = None

    def __enter__(self) -> AllocatorPeak:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)
        events = _allocation_events(self._profile.profiler.kineto_results.experimental_event_tree())
        self._profile = None
        self.peak, self.peak_corrected, self.unseen_frees = allocator_peaks(events)


def allocator_peaks(events: list[tuple[int, int, int, int]]) -> tuple[int, int, int]:
    """(peak as recorded, peak corrected for unseen frees, their count) of allocation events (time, bytes, the
    allocator's total after it, address): see `AllocatorPeak`."""
    events = sorted(events)
    base = events[0][2] - events[0][1] if events else 0  # the total before the first event
    peak = corrected = count = 0
    live: dict[int, int] = {}
    unseen = 0  # bytes freed on threads the profiler did not record, found by their address's reuse
    for _, size, total, ptr in events:
        peak = max(peak, total - base)
        if size > 0:
            if ptr in live:
                unseen += live[ptr]
                count += 1
            live[ptr] = size
        else:
            live.pop(ptr, None)
        corrected = max(corrected, total - base - unseen)
    return peak, corrected, count


def _allocation_events(roots: list) -> list[tuple[int, int, int, int]]:
    """(time, bytes, allocator total after it, address) of every CPU allocation (bytes > 0) and free (< 0) in the
    profiler's event tree."""
    found = []
    stack = list(roots)
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        extra = node.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation" and extra.device.type == "cpu":
            found.append((node.start_time_ns, extra.alloc_size, extra.total_allocated, extra.ptr))
    return found
