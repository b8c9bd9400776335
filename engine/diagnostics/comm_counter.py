"""Count the bytes every collective moves, per operation and per process group.

``CommCounter`` is a context manager. While it is installed, the collective entry points of
``torch.distributed`` (and the two function references DeepSpeed's torch backend captured at
start-up, ``cdb.all_gather_function`` / ``cdb.reduce_scatter_function``) are wrapped so each call
is recorded as a ``CommRecord``: operation name, the global ranks of its group, and the logical
size of the collective in bytes. Outside the ``with`` block nothing is patched, so the counter
has no effect when it is not installed.

Definitions (used by tests and ``bench/mics_vs_zero3.py``):

* ``nbytes`` (logical size X): the full tensor the collective is about -- the all-gather output,
  the reduce-scatter input, the all-reduce / broadcast / reduce tensor, the all-to-all input.
* ``ring_bytes``: what one rank sends under the ring model of the collective over g ranks:
  ``(g-1)/g * X`` for all-gather, reduce-scatter, broadcast, reduce and all-to-all, and
  ``2 (g-1)/g * X`` for all-reduce (the model of docs/internals.md#cost-model).
* ``cross_node_ring_bytes(ranks_per_node)``: the ring bytes of the collectives whose group holds
  ranks of more than one node (node = global rank // ranks_per_node). For the MiCS replica
  all-reduce every member sits on a different node, so all of it crosses the node boundary.

Only the outermost wrapped call is recorded: DeepSpeed's wrappers call into torch.distributed,
and torch's object collectives call tensor collectives, which must not be counted twice.
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Operation name -> (which bound argument holds the tensor(s) that define X, ring factor kind).
_OPS: dict[str, tuple[str, str]] = {
    "all_reduce": ("tensor", "allreduce"),
    "all_reduce_coalesced": ("tensors", "allreduce"),
    "all_gather_into_tensor": ("output_tensor", "gather"),
    "_all_gather_base": ("output_tensor", "gather"),
    "all_gather": ("tensor_list", "gather"),
    "reduce_scatter_tensor": ("input", "gather"),
    "_reduce_scatter_base": ("input", "gather"),
    "reduce_scatter": ("input_list", "gather"),
    "broadcast": ("tensor", "gather"),
    "reduce": ("tensor", "gather"),
    "all_to_all_single": ("input", "gather"),
    "all_to_all": ("input_tensor_list", "gather"),
}


@dataclass(frozen=True)
class CommRecord:
    """One collective call seen on this rank."""

    op: str
    ranks: tuple[int, ...]
    nbytes: int

    @property
    def group_size(self) -> int:
        return len(self.ranks)

    @property
    def ring_bytes(self) -> float:
        """Bytes this rank sends under the ring model (see module docstring)."""
        g = self.group_size
        if g <= 1:
            return 0.0
        factor = 2.0 if _OPS.get(self.op, ("", "gather"))[1] == "allreduce" else 1.0
        return factor * (g - 1) / g * self.nbytes

    def spans_nodes(self, ranks_per_node: int) -> bool:
        """Whether the group holds ranks of more than one node."""
        return len({r // ranks_per_node for r in self.ranks}) > 1


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class CommCounter:
    """Record every collective while installed: ``with CommCounter() as cc: ...; cc.records``."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()
        self._ranks_cache: dict[int, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    # -- installation -------------------------------------------------------------------
    def __enter__(self) -> CommCounter:  # noqa: PYI034 - python 3.10 has no typing.Self
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def install(self) -> None:
        """Wrap the collective entry points (idempotent per counter)."""
        if self._saved:
            return
        for module in (dist, c10d):
            for op in _OPS:
                original = getattr(module, op, None)
                if original is None or getattr(original, "_smp2ds_counted", False):
                    continue
                self._patch(module, op, self._wrap(op, original))
        cdb = _deepspeed_backend()
        if cdb is not None:
            for attr, op in (("all_gather_function", "all_gather_into_tensor"),
                             ("reduce_scatter_function", "reduce_scatter_tensor")):
                original = getattr(cdb, attr, None)
                if original is not None and not getattr(original, "_smp2ds_counted", False):
                    self._patch(cdb, attr, self._wrap(op, original))

    def uninstall(self) -> None:
        """Restore every patched attribute, in reverse order."""
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, replacement)

    def _wrap(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        arg_name = _OPS[op][0]
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):  # builtins without signatures: count nothing, still call
            signature = None

        def counted(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if depth == 0 and signature is not None:
                self._record(op, signature, arg_name, args, kwargs)
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        counted._smp2ds_counted = True  # type: ignore[attr-defined]
        return counted

    def _record(self, op: str, signature: inspect.Signature, arg_name: str, args: tuple, kwargs: dict) -> None:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return  # let the real call raise its own error
        params = list(signature.parameters)
        value = bound.arguments.get(arg_name)
        if value is None:
            # Names differ between torch and DeepSpeed wrappers (input vs input_tensor, ...).
            alt = [n for n in params if n in ("input_tensor", "input", "output_tensor", "output", "tensor")]
            value = bound.arguments.get(alt[0]) if alt else None
        group = bound.arguments.get("group")
        ranks = self._ranks(group)
        with self._lock:
            self.records.append(CommRecord(op, ranks, _tensor_bytes(value)))

    def _ranks(self, group: Any) -> tuple[int, ...]:
        key = id(group)
        if key not in self._ranks_cache:
            pg = group if group is not None else c10d._get_default_group()
            self._ranks_cache[key] = tuple(dist.get_process_group_ranks(pg))
        return self._ranks_cache[key]

    # -- queries ------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget what was recorded so far (patches stay installed)."""
        with self._lock:
            self.records.clear()

    def select(self, op: str | Iterable[str] | None = None, ranks: Iterable[int] | None = None) -> list[CommRecord]:
        """Records of ``op`` (a name or names) on the group with exactly ``ranks`` (any when None)."""
        ops = {op} if isinstance(op, str) else (set(op) if op is not None else None)
        want = tuple(sorted(ranks)) if ranks is not None else None
        return [r for r in self.records
                if (ops is None or r.op in ops) and (want is None or tuple(sorted(r.ranks)) == want)]

    def summary(self) -> dict[tuple[str, tuple[int, ...]], dict[str, float]]:
        """``{(op, ranks): {"calls", "bytes", "ring_bytes"}}`` over everything recorded."""
        out: dict[tuple[str, tuple[int, ...]], dict[str, float]] = defaultdict(
            lambda: {"calls": 0, "bytes": 0, "ring_bytes": 0.0})
        for r in self.records:
            entry = out[(r.op, r.ranks)]
            entry["calls"] += 1
            entry["bytes"] += r.nbytes
            entry["ring_bytes"] += r.ring_bytes
        return dict(out)

    def cross_node_ring_bytes(self, ranks_per_node: int) -> float:
        """Ring bytes this rank sent in collectives whose group spans more than one node."""
        return sum(r.ring_bytes for r in self.records if r.spans_nodes(ranks_per_node))

    def total_ring_bytes(self) -> float:
        return sum(r.ring_bytes for r in self.records)


def _deepspeed_backend() -> Any:
    """DeepSpeed's torch backend object if deepspeed.comm was initialised, else None."""
    import sys

    comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(comm, "cdb", None) if comm is not None else None
