"""Symbolic tracing of any ``nn.Module`` with ``torch.fx``, for the traced pipeline path.

`trace_model` returns the model's forward as one flat fx graph: calls of ``torch.nn`` leaf
modules (``nn.Linear``, ``nn.Conv2d``..., and tensor-parallel modules, whose collectives stay
inside them), reads of parameters and buffers, and the operations
between them; custom modules (``GroupedNet`` -> ``net1`` -> ``net2``) are traced through.

Arguments without a default are the graph's inputs (tensors at call time); arguments with a
default are traced at that default (``mask=None`` takes the ``if mask is not None:`` branch a
call without it takes), and a call that passes another value is refused (`TracedModel.fixed`).
When tracing fails, `TraceFailure` names the module whose code could not be traced and the
construct.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from smp2ds.engine.nn.parallel.group import is_tensor_parallel

_ASSERTS = {torch._assert, operator.eq, getattr(fx._symbolic_trace, "_assert_is_none", None)} - {None}


class TraceFailure(Exception):
    """``torch.fx`` could not trace the model; ``module`` is where, ``reason`` fx's message."""

    def __init__(self, module: str, reason: str):
        super().__init__(f"{module}: {reason}")
        self.module, self.reason = module, reason


@dataclass(frozen=True)
class TracedModel:
    """The traced forward of a model."""

    graph_module: fx.GraphModule
    """Holds the graph and the constants tracing created (``_tensor_constant0``...)."""
    inputs: tuple[str, ...]
    """Names of the forward's arguments that are graph inputs, in graph order."""
    fixed: dict[str, Any]
    """Arguments traced at their default value (name -> value)."""
    signature: inspect.Signature
    """Of ``model.forward`` (without ``self``), to bind a call's arguments."""


class _PathTracer(fx.Tracer):
    """fx's default tracer that remembers the innermost module whose code failed to trace."""

    def __init__(self) -> None:
        super().__init__()
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # Tensor-parallel modules run collectives inside: a stage calls them whole.
        return is_tensor_parallel(m) or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(m) or "(root)"
            raise


def trace_model(model: nn.Module) -> TracedModel:
    """Trace ``model.forward``; `TraceFailure` when fx cannot (see the module docstring)."""
    signature = inspect.signature(model.forward)
    variadic = [p.name for p in signature.parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise TraceFailure(type(model).__name__, f"forward takes *{variadic[0]}; a traced pipeline needs named "
                                                 "arguments")
    # Arguments with a default are traced at that default: fx cannot see through ``if mask is
    # not None:`` (a traced value is never None), and non-tensor values cannot be graph inputs.
    fixed = {p.name: p.default for p in signature.parameters.values() if p.default is not inspect.Parameter.empty}
    try:
        graph, tracer = _trace(model, fixed or None)
    except Exception as exc:  # noqa: BLE001 - fx raises many types; all are reported the same way
        raise _failure(model, exc) from exc
    if fixed:
        _drop_fixed_inputs(graph, fixed)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    inputs = tuple(str(n.target) for n in graph.nodes if n.op == "placeholder")
    return TracedModel(graph_module=gm, inputs=inputs, fixed=fixed, signature=signature)


def _trace(model: nn.Module, concrete: dict | None) -> tuple[fx.Graph, _PathTracer]:
    tracer = _PathTracer()
    try:
        return tracer.trace(model, concrete_args=concrete), tracer
    except Exception as exc:
        exc.smp2ds_module = tracer.failed_in  # type: ignore[attr-defined]
        raise


def _failure(model: nn.Module, exc: BaseException) -> TraceFailure:
    where = getattr(exc, "smp2ds_module", None) or "(root)"
    module = type(model).__name__ if where == "(root)" else f"{type(model).__name__}.{where}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return TraceFailure(module, f"{type(exc).__name__}: {text}")


def _drop_fixed_inputs(graph: fx.Graph, fixed: dict[str, Any]) -> None:
    """Remove the placeholders fx keeps for fixed arguments and the asserts that guard them.

    Our adapter checks a call's value against the default itself, before the pipeline runs;
    the graph then only takes the traced tensors.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = list(fixed)
    for node in placeholders:
        # fx renames fixed placeholders (mask -> mask_1): match by the default fx stored.
        original = _original_name(node, names)
        if original is None:
            continue
        for user in list(node.users):
            _erase_guard(graph, user)
        if not node.users:
            graph.erase_node(node)
    graph.lint()


def _original_name(node: fx.Node, names: list[str]) -> str | None:
    target = str(node.target)
    for name in names:
        if target == name or (target.startswith(f"{name}_") and target[len(name) + 1:].isdigit()):
            return name
    return None


def _erase_guard(graph: fx.Graph, node: fx.Node) -> None:
    if node.op != "call_function" or node.target not in _ASSERTS:
        return
    for user in list(node.users):
        _erase_guard(graph, user)
    if not node.users:
        graph.erase_node(node)
