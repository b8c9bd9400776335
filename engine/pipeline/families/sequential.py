"""``torch.nn.Sequential``: every child is one pipeline layer; the call takes one input.

The model is called with a single positional tensor (or tuple of tensors) and returns what the
last child returns; the loss is whatever the ``@smp.step`` function computes from that output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, UnsupportedModelError


def matches(model: nn.Module) -> bool:
    return isinstance(model, nn.Sequential)


class SequentialAdapter:
    """``model(x)`` -> layer 0 gets ``x``; the last layer's output is returned unchanged."""

    def pipe_inputs(self, args: tuple, kwargs: dict) -> Any:
        if kwargs or len(args) != 1:
            raise UnsupportedModelError(
                "a pipelined nn.Sequential is called with exactly one positional input (a tensor or a tuple of "
                f"tensors); got {len(args)} positional and keyword arguments {sorted(kwargs)}")
        x = args[0]
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
            return tuple(x)
        raise UnsupportedModelError(
            f"a pipelined nn.Sequential takes a tensor or a tuple of tensors, got {type(x).__name__}")

    def make_output(self, output: Any, args: tuple, kwargs: dict) -> Any:
        return output


def build(model: nn.Sequential) -> LayerList:
    if len(model) == 0:
        raise UnsupportedModelError("an empty nn.Sequential has no layers to pipeline")
    layers = tuple(PipeLayer(name=name, entry=child, modules=(child,), owners=(child,))
                   for name, child in model.named_children())
    return LayerList(family="nn.Sequential", layers=layers, adapter=SequentialAdapter(), model=model)
