"""Activation offloading for checkpointed modules (SMP v1 ``offload_activations`` /
``activation_loading_horizon``).

A checkpointed module call (``smp.set_activation_checkpointing``, ``smp.checkpoint``,
``smp.checkpoint_sequential``) keeps only its inputs for backward and recomputes the rest. With
``offload_activations: true`` those kept inputs live in CPU memory between forward and backward:

* **pack** (forward, inside the checkpointed call): every tensor the call saves for backward is
  copied into a separate CPU tensor (pinned memory and ``non_blocking`` when the source is on a
  CUDA device, with an event marking the end of the copy); autograd then drops its reference to the
  device tensor, so only the CPU copy stays alive.
* **unpack** (backward, just before the call is recomputed): the tensor is returned on its original
  device. The tensors of one checkpointed call form one *activation*, numbered in forward order
  within a forward pass.
* **prefetch**: when backward unpacks activation ``k`` it starts copying back the activations
  backward needs next, ``k-1, k-2, ...`` (reverse forward order), at most ``horizon`` of them
  (``activation_loading_horizon``), and never more than ``horizon`` prefetched-but-not-yet-consumed
  activations at once. On CUDA the copies run on a side stream and the compute stream waits on an
  event before it uses them; elsewhere (CPU) the copy is synchronous.

On a CPU-only run the "device" is the CPU: pack still makes a real copy (the original saved tensor
is released by autograd) and unpack/prefetch still make a real copy back, so the CPU copy is never
handed to the recomputation (an in-place op there cannot corrupt it) and the counters mean the same
thing as on a GPU.

Counters (:func:`offload_stats`) are **cumulative** for the process; :func:`reset_offload_stats`
sets them back to zero (tests call it before each step). The offloader itself is process-global
(:func:`get_offloader`); :class:`ActivationOffloader` can also be instantiated on its own.

Prefetching assumes backward needs the activations in reverse forward order (the usual case,
also for several micro-batches run one after the other: each forward pass numbers its own
activations). When backward skips some (e.g. it only reaches part of the graph), those stay counted
as prefetched until their tensors are freed, which narrows the window but never widens it. A second
backward through the same graph (``retain_graph=True``) reloads every activation again, on demand.

Scope: only tensors the checkpoint machinery saves through ``saved_tensors_hooks`` are offloaded,
i.e. the positional tensor inputs of the checkpointed call (tensors passed as keyword arguments are
captured by torch's recompute closure and stay where they are). A checkpointed call nested inside
another one, or one run while backward recomputes an outer call, is not offloaded again (the outer
call's inputs are).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from smp2ds.engine.exceptions import SMPInvalidArgumentError

__all__ = [
    "ActivationOffloader",
    "OffloadStats",
    "get_offloader",
    "offload_stats",
    "reset_offload_stats",
]


@dataclass(frozen=True)
class OffloadStats:
    """A snapshot of the offloader's cumulative counters (see :func:`reset_offload_stats`)."""

    activations_offloaded: int = 0
    """Checkpointed calls whose saved tensors were moved to CPU (one per call, per forward)."""
    tensors_offloaded: int = 0
    """Saved tensors moved to CPU (a call with several tensor inputs counts each)."""
    bytes_offloaded: int = 0
    """Bytes copied to CPU memory by pack."""
    bytes_reloaded: int = 0
    """Bytes copied back to the compute device (prefetched or on demand)."""
    activations_prefetched: int = 0
    """Activations copied back ahead of use because a later activation was unpacked."""
    activations_loaded_on_demand: int = 0
    """Activations copied back only when backward asked for them (not prefetched in time)."""
    activations_consumed: int = 0
    """Activations backward has started using (first unpack of the activation)."""
    max_prefetched_unconsumed: int = 0
    """Largest number of activations prefetched and not yet consumed seen at one time."""
    forward_passes: int = 0
    """Forward passes that offloaded at least one activation."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class _Pass:
    """One forward pass: its activations, numbered in forward order, and the prefetch window."""

    def __init__(self, horizon: int):
        self.horizon = horizon
        self.next_index = 0
        self.activations: dict[int, _Activation] = {}
        self.in_flight: set[int] = set()
        self.backward_started = False


class _Activation:
    """The tensors one checkpointed call saved; holds only weak references to them."""

    def __init__(self, pass_: _Pass, index: int):
        self.pass_ = pass_
        self.index = index
        self.entries: list[weakref.ref[_Packed]] = []
        self.live = 0
        self.consumed = False


class _Packed:
    """What autograd stores instead of the device tensor (returned by pack, given to unpack)."""

    __slots__ = ("activation", "cpu", "device", "d2h_event", "reloaded", "h2d_event", "__weakref__")

    def __init__(self, activation: _Activation | None, cpu: torch.Tensor, device: torch.device,
                 d2h_event: Any = None):
        self.activation = activation
        self.cpu = cpu
        self.device = device
        self.d2h_event = d2h_event
        self.reloaded: torch.Tensor | None = None
        self.h2d_event: Any = None


class _Passthrough:
    """A saved tensor that cannot be offloaded (sparse, meta, subclass): kept as is."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _offloadable(t: torch.Tensor) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided
            and not t.is_meta and not t.is_quantized and not t.is_nested)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _hooks_enabled() -> bool:
    check = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return check is None or bool(check())


class ActivationOffloader:
    """Moves the tensors saved by checkpointed calls to CPU and prefetches them back in backward.

    Use :meth:`call` around one checkpointed call (``with offloader.call(horizon): checkpoint(...)``).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        self._pass: _Pass | None = None
        self._streams: dict[torch.device, Any] = {}
        self.reset_stats()

    # ---- counters ----------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Set every counter back to zero (activations already offloaded still reload normally)."""
        with self._lock:
            self._stats = {k: 0 for k in OffloadStats.__dataclass_fields__}

    def stats(self) -> OffloadStats:
        with self._lock:
            return OffloadStats(**self._stats)

    def _add(self, key: str, value: int = 1) -> None:
        self._stats[key] += value

    # ---- forward -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self, horizon: int) -> Iterator[None]:
        """Offload what the checkpointed call run inside this block saves for backward.

        A no-op when nested in another offloaded call on this thread, when run inside a backward
        pass (recomputation of an outer checkpointed call), when grad mode is off, or when saved
        tensor hooks are disabled.
        """
        depth = getattr(self._local, "depth", 0)
        if (depth > 0 or not torch.is_grad_enabled() or _in_backward() or not _hooks_enabled()):
            yield
            return
        horizon = _check_horizon(horizon)
        slot: list[_Activation | None] = [None]

        def pack(t: torch.Tensor) -> Any:
            return self._pack(t, slot, horizon)

        self._local.depth = depth + 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            self._local.depth = depth

    def _new_activation(self, horizon: int) -> _Activation:
        with self._lock:
            current = self._pass
            if current is None or current.backward_started or not current.activations:
                current = self._pass = _Pass(horizon)
                self._add("forward_passes")
            current.horizon = horizon
            act = _Activation(current, current.next_index)
            current.next_index += 1
            current.activations[act.index] = act
            self._add("activations_offloaded")
            return act

    def _pack(self, t: torch.Tensor, slot: list, horizon: int) -> Any:
        if not _offloadable(t):
            return _Passthrough(t)
        if slot[0] is None:
            slot[0] = self._new_activation(horizon)
        act: _Activation = slot[0]
        device = t.device
        event = None
        if device.type == "cuda":
            cpu = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu", pin_memory=True)
            cpu.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        else:
            cpu = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu")
            cpu.copy_(t)
        packed = _Packed(act, cpu, device, event)
        with self._lock:
            act.entries.append(weakref.ref(packed, lambda _ref, a=act: self._entry_dead(a)))
            act.live += 1
            self._add("tensors_offloaded")
            self._add("bytes_offloaded", _nbytes(t))
        return packed

    def _entry_dead(self, act: _Activation) -> None:
        """Autograd freed one packed tensor; forget the activation once all of them are gone."""
        with self._lock:
            act.live -= 1
            if act.live <= 0:
                act.pass_.activations.pop(act.index, None)
                act.pass_.in_flight.discard(act.index)
                act.entries.clear()  # the weakrefs' callbacks refer back to act: break the cycle

    # ---- backward ----------------------------------------------------------------------------
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Passthrough):
            return packed.tensor
        act = packed.activation
        with self._lock:
            pass_ = act.pass_
            pass_.backward_started = True
            if not act.consumed:
                act.consumed = True
                self._add("activations_consumed")
            if act.index in pass_.in_flight:
                pass_.in_flight.discard(act.index)
            if packed.reloaded is None:
                # Not prefetched (the first activation backward needs, or out of order): load all
                # of this activation's tensors now, then hand this one over.
                if self._load(act):
                    self._add("activations_loaded_on_demand")
            tensor, event = packed.reloaded, packed.h2d_event
            packed.reloaded = packed.h2d_event = None
            self._prefetch_after(pass_, act.index)
        if tensor is None:  # the entry was loaded by an earlier unpack (retain_graph): load again
            tensor, event = self._copy_back(packed)
            with self._lock:
                self._add("bytes_reloaded", _nbytes(tensor))
        if event is not None:
            stream = torch.cuda.current_stream(tensor.device)
            stream.wait_event(event)
            tensor.record_stream(stream)
        return tensor

    def _prefetch_after(self, pass_: _Pass, index: int) -> None:
        """Start loading ``index-1 ... index-horizon`` while the window has room."""
        horizon = pass_.horizon
        for j in range(index - 1, max(-1, index - 1 - horizon), -1):
            if len(pass_.in_flight) >= horizon:
                break
            act = pass_.activations.get(j)
            if act is None or act.consumed or j in pass_.in_flight:
                continue
            if self._load(act):
                pass_.in_flight.add(j)
                self._add("activations_prefetched")
                self._stats["max_prefetched_unconsumed"] = max(self._stats["max_prefetched_unconsumed"],
                                                               len(pass_.in_flight))

    def _load(self, act: _Activation) -> bool:
        """Copy every live tensor of ``act`` back to its device; True if anything was copied."""
        loaded = False
        for ref in act.entries:
            packed = ref()
            if packed is None or packed.reloaded is not None:
                continue
            packed.reloaded, packed.h2d_event = self._copy_back(packed)
            self._add("bytes_reloaded", _nbytes(packed.cpu))
            loaded = True
        return loaded

    def _copy_back(self, packed: _Packed) -> tuple[torch.Tensor, Any]:
        device = packed.device
        if device.type != "cuda":
            out = torch.empty(packed.cpu.size(), dtype=packed.cpu.dtype, device=device)
            out.copy_(packed.cpu)
            return out, None
        side = self._side_stream(device)
        with torch.cuda.stream(side):
            if packed.d2h_event is not None:
                side.wait_event(packed.d2h_event)
            out = torch.empty(packed.cpu.size(), dtype=packed.cpu.dtype, device=device)
            out.copy_(packed.cpu, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return out, event

    def _side_stream(self, device: torch.device) -> Any:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream


def _check_horizon(horizon: Any) -> int:
    if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
        raise SMPInvalidArgumentError(f"activation_loading_horizon must be an integer >= 1, got {horizon!r}")
    return horizon


_OFFLOADER = ActivationOffloader()


def get_offloader() -> ActivationOffloader:
    """The process-global offloader every checkpointed call uses."""
    return _OFFLOADER


def offload_stats() -> OffloadStats:
    """Cumulative counters of the process-global offloader (reset with :func:`reset_offload_stats`)."""
    return _OFFLOADER.stats()


def reset_offload_stats() -> None:
    """Zero the process-global offloader's counters."""
    _OFFLOADER.reset_stats()
