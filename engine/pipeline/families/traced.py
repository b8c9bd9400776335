"""Any other ``nn.Module``: its forward traced with ``torch.fx`` and cut into layers.

The general path behind the named families (SMP partitions any module): `fx_trace` traces the
forward, `fx_segments` cuts it where a cut is possible (between ``torch.nn`` leaf modules; see
there), and the model is called like the original, with its forward's arguments, which must be
tensors (or, for arguments traced at their default, that default). Manual placement works on
the original modules (``smp.partition`` / ``smp.set_partition`` on ``net2`` places every layer
using ``net2``'s parameters); auto placement balances the layers' costs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp2ds.engine.pipeline.fx_segments import split_traced
from smp2ds.engine.pipeline.fx_trace import TracedModel, TraceFailure, trace_model
from smp2ds.engine.pipeline.layers import SUPPORTED, LayerList, PipeLayer, UnsupportedModelError

MANUAL_ROUTE = ("express the model as a torch.nn.Sequential whose children each take and return one tensor (or a "
                "tuple of tensors), with the loss computed from its output inside the @smp.step function; stage "
                "placement then follows memory_weight, or smp.partition(i) / smp.set_partition(child, i) with "
                "auto_partition: false")


def matches(model: nn.Module) -> bool:
    return isinstance(model, nn.Module)


class TracedAdapter:
    """``model(*args, **kwargs)`` -> the traced inputs; the last layer's output is the model's output."""

    def __init__(self, traced: TracedModel, model_name: str):
        self.signature, self.inputs, self.fixed = traced.signature, traced.inputs, traced.fixed
        self.model_name = model_name

    def pipe_inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise UnsupportedModelError(f"{self.model_name}.forward{self.signature} cannot take this call: {exc}") \
                from exc
        given = dict(bound.arguments)
        for name, default in self.fixed.items():
            if name in given and not _same(given[name], default):
                raise UnsupportedModelError(
                    f"{self.model_name}.forward was traced for the pipeline with {name}={default!r} (arguments "
                    f"with a default are traced at their default), but this call passes {name}="
                    f"{_describe(given[name])}; to pass {name}, give it no default in forward, or {MANUAL_ROUTE}")
        bound.apply_defaults()
        values = []
        for name in self.inputs:
            value = bound.arguments[name]
            if not isinstance(value, torch.Tensor):
                raise UnsupportedModelError(
                    f"argument {name!r} of {self.model_name}.forward is {_describe(value)}: a traced pipeline model "
                    "takes tensors for the arguments it traced as inputs")
            values.append(value)
        return tuple(values)

    def make_output(self, output: Any, args: tuple, kwargs: dict) -> Any:
        return output


def _same(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or isinstance(default, torch.Tensor):
        return False
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - an odd __eq__ means "not the default"
        return False


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{value!r} ({type(value).__name__})" if value is None or isinstance(value, (bool, int, float, str)) \
        else f"a {type(value).__name__}"


def build(model: nn.Module) -> LayerList:
    name = f"{type(model).__module__}.{type(model).__name__}"
    try:
        traced = trace_model(model)
    except TraceFailure as exc:
        raise UnsupportedModelError(
            f"pipeline parallelism splits a {name} by tracing its forward with torch.fx, and tracing failed in "
            f"{exc.module}: {exc.reason}. Python control flow on tensor values, data-dependent shapes and "
            f"untraceable calls stop torch.fx; make that forward traceable, or use a model with a pipeline layer "
            f"list ({', '.join(SUPPORTED)}), or {MANUAL_ROUTE}.") from exc
    if not traced.inputs:
        raise UnsupportedModelError(
            f"pipeline parallelism cannot split a {name}: every argument of its forward{traced.signature} has a "
            "default, and a traced pipeline model takes its tensors through arguments without one (arguments "
            f"with a default are traced at it); give the tensor arguments no default, or {MANUAL_ROUTE}.")
    segments, why_not = split_traced(traced, model)
    if len(segments) < 2:
        reasons = "; ".join(why_not[:3]) or "it uses no parameters in more than one torch.nn module"
        raise UnsupportedModelError(
            f"pipeline parallelism cannot split a {name}: its traced forward has no place to cut between stages "
            f"({reasons}). Pipeline layer lists exist for {', '.join(SUPPORTED)}; for other models, "
            f"{MANUAL_ROUTE}.")
    layers = tuple(PipeLayer(name=s.name, entry=s.layer, modules=(s.layer,), owners=s.owners) for s in segments)
    slots = tuple(slot for s in segments for slot in s.buffer_slots)
    return LayerList(family="torch.fx traced", layers=layers, adapter=TracedAdapter(traced, type(model).__name__),
                     model=model, buffer_slots=slots)

