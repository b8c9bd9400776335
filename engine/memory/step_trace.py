"""One forward and backward traced by PyTorch's memory tracker, on fake (or real) tensors.

``MemTracker`` attributes every tensor storage to parameters, buffers, gradients, activations
(tensors made inside a module's forward and kept for backward), optimizer state, transient tensors
(made and freed inside forward or backward) and others (inputs). Under ``FakeTensorMode`` no storage
is allocated, yet the tracker sees the same tensors with the same sizes, so the peak it reports is the
one a real step would reach. Gradients are allocated before the step (as they are from the second step
on, or from the second micro-batch on): the trace is of a step in steady state. Under ZeRO-3 (sharded data
parallelism) no gradient outlives its micro-batch's backward, so the trace starts without them and sees each
whole gradient from the moment autograd makes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType


@dataclass(frozen=True)
class StepTrace:
    """Bytes seen by the tracker (summed over devices)."""

    parameters: int
    """Parameters and buffers of the traced modules."""
    gradients: int
    saved_activations: int
    """Activations alive when forward ends: what one micro-batch keeps until its backward."""
    peak: int
    """All tracked bytes at the step's peak."""
    peak_activations: int
    peak_transient: int
    """Transient tensors and inputs (neither parameter, gradient nor saved activation) at the peak."""
    final_gradients: int = 0
    """Gradients alive when backward ends."""
    final_held: int = 0
    """Everything else alive when backward ends, before the step drops its output (the logits, a cache)."""


class _DeviceTotalsTracker(MemTracker):
    """``MemTracker`` keeping only the per-device peaks. Its per-module peaks, updated on every operator by
    walking every module seen so far, made a 20-block stage of a 70B model take minutes; the estimate reads
    device totals only."""

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


def _kind(snapshot: dict[Any, dict[Any, int]], *kinds: _MemRefType) -> int:
    return sum(int(per_device.get(kind, 0)) for per_device in snapshot.values() for kind in kinds)


def _total(snapshot: dict[Any, dict[Any, int]]) -> int:
    return sum(int(per_device.get("Total", 0)) for per_device in snapshot.values())


def backward_from(output: Any) -> None:
    """Backward from a scalar loss, or from every floating tensor needing a gradient in ``output``
    (a pipeline stage's outputs, with gradients of ones standing for the next stage's)."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        output.backward()
        return
    items = output if isinstance(output, (tuple, list)) else (output,)
    tensors = [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        raise ValueError("the traced step produced no tensor that needs a gradient")
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def _unique_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen[id(p)] = p
    return list(seen.values())


def trace_step(run: Callable[[], Any], tracked: Sequence[nn.Module], *, preallocate_grads: bool = True) -> StepTrace:
    """Trace ``run()`` (the forward, returning a loss or the stage's outputs) and its backward.

    ``tracked``: the modules whose parameters this rank holds; with ``preallocate_grads`` their gradients are
    allocated first (held across micro-batches), else made by the backward (ZeRO-3 reduces and frees them).
    """
    for p in _unique_parameters(tracked) if preallocate_grads else ():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    tracker = _DeviceTotalsTracker()
    tracker.track_external(*tracked)
    with tracker:
        output = run()
        after_forward = tracker.get_tracker_snapshot()
        backward_from(output)
        after_backward = tracker.get_tracker_snapshot()
        del output
        peak = tracker.get_tracker_snapshot("peak")
    return StepTrace(
        parameters=_kind(after_forward, _MemRefType.PARAM, _MemRefType.BUFFER),
        gradients=_kind(peak, _MemRefType.GRAD),
        saved_activations=_kind(after_forward, _MemRefType.ACT),
        peak=_total(peak),
        peak_activations=_kind(peak, _MemRefType.ACT),
        peak_transient=_kind(peak, _MemRefType.TEMP, _MemRefType.OTH),
        final_gradients=_kind(after_backward, _MemRefType.GRAD),
        final_held=_total(after_backward) - _kind(after_backward, _MemRefType.PARAM, _MemRefType.BUFFER,
                                                   _MemRefType.GRAD),
    )
