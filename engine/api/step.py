"""``@smp.step``: run a function once per micro-batch and collect ``StepOutput`` values.

The decorator does not own the micro-batch loop: it asks the ``DistributedModel`` to run the
step (``model.run_step(step_fn, args, kwargs)``), whose backend loops here in this process
(data parallelism, MiCS) or hands the mini-batch to DeepSpeed's pipeline engine. A backend gets
this ``StepFunction`` and uses :meth:`StepFunction.split` and :attr:`StepFunction.func`. Before
that, the model moves the call's tensors to its device with :meth:`StepFunction.to_device` (SMP's
placement, :mod:`smp2ds.engine.core.device_placement`; nothing happens when it runs on the CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from smp2ds.engine.api.torch_compile import ensure_compiled
from smp2ds.engine.core.device_placement import arguments_to_device
from smp2ds.engine.core.microbatch_split import Piece, check_spec, positional_names, split_named
from smp2ds.engine.core.state import state
from smp2ds.engine.core.step_output import collect
from smp2ds.engine.diagnostics import step_log
from smp2ds.engine.exceptions import MissingDistributedModelError


class StepFunction:
    """A function decorated with ``@smp.step``; calling it runs one SMP step."""

    def __init__(self, func: Callable[..., Any], non_split_inputs: Any = None, input_split_axes: Any = None,
                 detach_outputs: bool = True):
        self.func = func
        self.non_split_inputs, self.input_split_axes = check_spec(non_split_inputs, input_split_axes)
        self.detach_outputs = bool(detach_outputs)
        self._names: dict[int, list[str]] = {}  # positional count -> parameter names (signature is slow)
        functools.update_wrapper(self, func)

    def _positional_names(self, count: int) -> list[str]:
        names = self._names.get(count)
        if names is None:
            names = self._names[count] = positional_names(self.func, count)
        return names

    def split(self, args: tuple, kwargs: dict, num_microbatches: int) -> list[Piece]:
        """The per-micro-batch ``(args, kwargs)`` of one call."""
        names = self._positional_names(len(args))
        return split_named(names, args, kwargs, num_microbatches, self.non_split_inputs, self.input_split_axes)

    def to_device(self, args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
        """One call's arguments with their tensors on the model's ``device`` (SMP's placement; see
        :mod:`smp2ds.engine.core.device_placement`), ``non_split_inputs`` included."""
        return arguments_to_device(self._positional_names(len(args)), args, kwargs, device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state.require()
        model = state.model
        if model is None:
            raise MissingDistributedModelError(
                f"smp.step function {self.func.__name__!r} was called before smp.DistributedModel(...) existed; "
                "wrap the model first"
            )
        if state.watchdog is not None:
            state.watchdog.forget_position()  # between steps: hold no finished collective's frame
        ensure_compiled(model)  # SMP2DS_COMPILE=1 (an smp2ds setting): DeepSpeed's engine.compile(), once
        started = step_log.step_started()
        outputs = collect(model.run_step(self, args, kwargs), self.detach_outputs)
        step_log.step_finished(started, outputs)  # SMP2DS_LOG=info: one line every SMP2DS_LOG_FREQ steps
        return outputs

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Decorating a method: bind like a function would.
        if obj is None:
            return self
        return functools.partial(self.__call__, obj)


def step(func: Callable[..., Any] | None = None, non_split_inputs: Any = None, input_split_axes: Any = None,
         detach_outputs: bool = True) -> Any:
    """``@smp.step`` or ``@smp.step(non_split_inputs=None, input_split_axes=None, detach_outputs=True)``."""
    if func is not None and not callable(func):
        # smp.step(["x"]) : positional non_split_inputs
        non_split_inputs, func = func, None
    if func is not None:
        return StepFunction(func, non_split_inputs, input_split_axes, detach_outputs)

    def decorate(f: Callable[..., Any]) -> StepFunction:
        return StepFunction(f, non_split_inputs, input_split_axes, detach_outputs)

    return decorate
