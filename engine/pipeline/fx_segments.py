"""Cutting a traced forward (`fx_trace`) into a chain of pipeline layers.

DeepSpeed's `PipelineModule` runs layers one after the other, each taking one tensor or tuple of
tensors and returning one. The traced graph is cut before nodes that use parameters or buffers
(a ``torch.nn`` leaf module call, a parameter read), so each layer holds one leaf module (or a
parameter read) plus the parameter-free operations after it, and auto or manual partitioning
can place the cut between any two of them. A cut is only made where

* no parameter or buffer is used on both sides (a weight used twice, e.g. tied embeddings,
  keeps everything between its uses in one layer, so it lives on one stage), and
* every value crossing it is a tensor (a Python number such as ``x.size(0)`` cannot travel
  between stages; recognised statically, and checked at run time).

Each layer is a `TracedLayer`: a small ``GraphModule`` over the original modules and parameters
(shared, not copied), taking the values live before it and returning those live after it; the
last one returns what the model's forward returns.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from smp2ds.engine.pipeline.fx_trace import TracedModel
from smp2ds.engine.pipeline.layers import UnsupportedModelError

_NON_TENSOR_METHODS = {"size", "dim", "ndimension", "numel", "nelement", "item", "tolist", "stride",
                       "element_size", "get_device", "is_contiguous", "is_floating_point", "chunk", "split",
                       "unbind", "tensor_split", "split_with_sizes", "sort", "topk", "kthvalue", "unique"}
_NON_TENSOR_FUNCTIONS = {getattr, len, torch.split, torch.chunk, torch.unbind, torch.tensor_split, torch.sort,
                         torch.topk, torch.meshgrid, torch.broadcast_tensors, torch.unique}
_TUPLE_MODULES = (nn.RNNBase, nn.MultiheadAttention)


class SegmentError(UnsupportedModelError):
    """A layer produced a value that cannot cross to the next layer (found at run time)."""


@dataclass(frozen=True)
class Segment:
    """One layer cut from the traced graph."""

    name: str
    """Path of the first module (or parameter holder) the layer uses."""
    layer: nn.Module
    owners: tuple[nn.Module, ...]
    """Original modules whose parameters or buffers the layer uses (manual partition)."""
    buffer_slots: tuple[tuple[nn.Module, str, str], ...]
    """``(holder, attribute, state_dict key)`` for buffers read directly (not via their module)."""


class _Anchor(torch.autograd.Function):
    """Identity on ``out`` whose backward also gives the ``inputs`` a (zero) gradient.

    DeepSpeed sends back the gradient of every floating-point tensor a stage received and asserts
    it exists; a received value used only without gradient (a float mask compared, a size read)
    would have none.
    """

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.specs = [(t.shape, t.dtype, t.device) for t in inputs]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple:
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.specs))


class TracedLayer(nn.Module):
    """One pipeline layer: runs its part of the traced graph on the values live before it."""

    def __init__(self, graph_module: fx.GraphModule, input_names: tuple[str, ...], output_names: tuple[str, ...],
                 final: bool):
        super().__init__()
        self.graph_module = graph_module
        self.input_names, self.output_names, self.final = input_names, output_names, final

    def forward(self, inputs: Any) -> Any:
        values = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        out = self.graph_module(*values)
        if self.final:
            return self._anchor_final(values, out) if torch.is_grad_enabled() else out
        out = tuple(out)
        for name, value in zip(self.output_names, out):
            if not isinstance(value, torch.Tensor):
                raise SegmentError(f"value {name!r} crosses from one pipeline layer to a later one but is a "
                                   f"{type(value).__name__}, not a tensor; only tensors travel between pipeline "
                                   "stages: compute it inside one torch.nn module, or make it a tensor")
        if not torch.is_grad_enabled():
            return out
        # DeepSpeed backpropagates every floating-point tensor a stage sends; one without a graph
        # (the input data passed on to a later layer, a constant) becomes a leaf that accepts it.
        out = tuple(t.detach().requires_grad_() if t.is_floating_point() and not t.requires_grad else t for t in out)
        return self._anchor(values, out)

    @classmethod
    def _anchor_final(cls, inputs: tuple, out: Any) -> Any:
        """The model's output with the anchor on its first tensor (or tuple/list/dict entry)."""
        if isinstance(out, torch.Tensor):
            return cls._anchor(inputs, (out,))[0]
        if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in out):
            return type(out)(cls._anchor(inputs, tuple(out)))
        if type(out) is dict and all(isinstance(t, torch.Tensor) for t in out.values()):
            return dict(zip(out, cls._anchor(inputs, tuple(out.values()))))
        return out

    @staticmethod
    def _anchor(inputs: tuple, out: tuple) -> tuple:
        passed = {id(t) for t in out}
        consumed = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in passed]
        carrier = next((i for i, t in enumerate(out) if t.is_floating_point() and t.requires_grad), None)
        if not consumed or carrier is None:
            return out
        anchored = list(out)
        anchored[carrier] = _Anchor.apply(out[carrier], *consumed)
        return tuple(anchored)


def split_traced(traced: TracedModel, model: nn.Module) -> tuple[list[Segment], list[str]]:
    """The layers of ``traced`` and, when fewer than two, why no cut was possible."""
    graph = traced.graph_module.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    nodes = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    output = next(n for n in graph.nodes if n.op == "output")
    index = {n: i for i, n in enumerate(nodes)}
    index.update({n: -1 for n in placeholders})
    index[output] = len(nodes)
    resolver = _Resolver(model, traced.graph_module)
    touched = [resolver.tensors_of(n) for n in nodes]
    kinds = _kinds(placeholders + nodes, resolver)
    last_use = {v: max((index[u] for u in v.users), default=index[v]) for v in placeholders + nodes}
    spans = _spans(touched)

    cuts, why_not = [0], []
    live = {v: None for v in placeholders if last_use[v] >= 0}
    lives = [tuple(live)]
    first_touch = next((i for i, t in enumerate(touched) if t), None)
    for j in range(1, len(nodes) + 1):
        prev = nodes[j - 1]
        if last_use[prev] >= j:
            live[prev] = None
        for v in [v for v in live if last_use[v] < j]:
            del live[v]
        lives.append(tuple(live))
        if j == len(nodes) or not touched[j] or first_touch is None or j <= first_touch:
            continue
        reason = _blocked(j, spans, resolver) or _non_tensor(live, kinds)
        if reason is None and not live:
            reason = "nothing flows into the rest of the forward"
        if reason is None:
            cuts.append(j)
        else:
            why_not.append(f"no cut before {nodes[j].target}: {reason}")
    cuts.append(len(nodes))

    segments = []
    for a, b in zip(cuts, cuts[1:]):
        final = b == len(nodes)
        inputs, outputs = lives[a], () if final else lives[b]
        segments.append(_build(resolver, nodes[a:b], inputs, outputs, output if final else None))
    return segments, why_not


def _spans(touched: list[set[int]]) -> dict[int, tuple[int, int]]:
    spans: dict[int, tuple[int, int]] = {}
    for i, ids in enumerate(touched):
        for t in ids:
            first, _ = spans.get(t, (i, i))
            spans[t] = (first, i)
    return spans


def _blocked(j: int, spans: dict[int, tuple[int, int]], resolver: _Resolver) -> str | None:
    for t, (first, last) in spans.items():
        if first < j <= last:
            return f"{resolver.name_of(t)} is used on both sides"
    return None


def _non_tensor(live: dict, kinds: dict) -> str | None:
    weights = [str(v.target) for v in live if kinds[v] == "attribute"]
    if weights:
        return f"{weights} would cross as values (a parameter stays with the layer that reads it)"
    others = [v.name for v in live if kinds[v] != "tensor"]
    return f"non-tensor value(s) {others} would cross" if others else None


def _kinds(values: list[fx.Node], resolver: _Resolver) -> dict[fx.Node, str]:
    """``"tensor"``, ``"attribute"`` (a parameter/buffer read) or ``"other"`` per value, statically.

    Unknown calls count as tensors; `TracedLayer` checks at run time.
    """
    kinds: dict[fx.Node, str] = {}
    for v in values:
        if v.op == "get_attr":
            kind = "attribute"
        elif v.op == "call_method" and v.target in _NON_TENSOR_METHODS:
            kind = "other"
        elif v.op == "call_function" and v.target in _NON_TENSOR_FUNCTIONS:
            kind = "other"
        elif v.op == "call_function" and getattr(v.target, "__module__", None) == "_operator":
            node_args = [a for a in v.all_input_nodes]
            if v.target is operator.getitem:
                kind = kinds.get(node_args[0], "tensor") if node_args else "other"
            else:
                kind = "tensor" if any(kinds.get(a) == "tensor" for a in node_args) else "other"
        elif v.op == "call_module" and isinstance(resolver.module(v.target), _TUPLE_MODULES):
            kind = "other"
        else:
            kind = "tensor"
        kinds[v] = kind
    return kinds


class _Resolver:
    """Finds call/attribute targets in the original model (constants in the traced module)."""

    def __init__(self, model: nn.Module, traced: fx.GraphModule):
        self.model, self.traced = model, traced
        self._names: dict[int, str] = {}
        for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
                model.named_buffers(remove_duplicate=False)):
            self._names.setdefault(id(t), name)

    def module(self, target: str) -> nn.Module:
        try:
            return self.model.get_submodule(target)
        except AttributeError:
            return self.traced.get_submodule(target)

    def attribute(self, target: str) -> tuple[nn.Module | None, Any]:
        """``(holder in the model or None, value)`` of a ``get_attr`` target."""
        prefix, _, field = target.rpartition(".")
        try:
            holder = self.model.get_submodule(prefix)
            return holder, getattr(holder, field)
        except AttributeError:
            return None, self.traced.get_submodule(prefix).__getattr__(field)

    def tensors_of(self, node: fx.Node) -> set[int]:
        if node.op == "call_module":
            module = self.module(str(node.target))
            return {id(t) for t in list(module.parameters()) + list(module.buffers())}
        if node.op == "get_attr":
            holder, value = self.attribute(str(node.target))
            if holder is not None and isinstance(value, torch.Tensor):
                return {id(value)}
        return set()

    def name_of(self, tensor_id: int) -> str:
        return self._names.get(tensor_id, "a tensor")

    def owners(self, node: fx.Node) -> list[tuple[str, nn.Module]]:
        """Original modules whose parameters or buffers ``node`` uses (parameter-free calls: none)."""
        if not self.tensors_of(node):
            return []
        if node.op == "call_module":
            return [(str(node.target), self.module(str(node.target)))]
        if node.op == "get_attr":
            holder, value = self.attribute(str(node.target))
            if holder is not None and isinstance(value, torch.Tensor):
                return [(str(node.target), holder)]
        return []


def _build(resolver: _Resolver, nodes: list[fx.Node], inputs: tuple, outputs: tuple,
           output: fx.Node | None) -> Segment:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for v in inputs:
        env[v] = graph.placeholder(v.name)
    root: dict[str, Any] = {}
    owners: dict[int, tuple[str, nn.Module]] = {}
    buffers: list[tuple[str, Any]] = []
    for n in nodes:
        env[n] = graph.node_copy(n, lambda x: env[x])
        if n.op == "call_module":
            root[str(n.target)] = resolver.module(str(n.target))
        elif n.op == "get_attr":
            holder, value = resolver.attribute(str(n.target))
            root[str(n.target)] = value
            if holder is not None and isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                buffers.append((str(n.target), value))
        for name, module in resolver.owners(n):
            owners.setdefault(id(module), (name, module))
    if output is not None:
        graph.output(fx.map_arg(output.args[0], lambda x: env[x]))
    else:
        graph.output(tuple(env[v] for v in outputs))
    gm = fx.GraphModule(root, graph, f"{type(resolver.model).__name__}Layer")
    slots = []
    for target, _ in buffers:
        prefix, _, field = target.rpartition(".")
        slots.append((gm.get_submodule(prefix), field, target))
    named = list(owners.values())
    name = named[0][0] if named else "(no parameters)"
    if len(named) > 1:
        name = f"{name} .. {named[-1][0]}"
    layer = TracedLayer(gm, tuple(v.name for v in inputs), tuple(v.name for v in outputs), output is not None)
    return Segment(name=name, layer=layer, owners=tuple(m for _, m in named), buffer_slots=tuple(slots))
