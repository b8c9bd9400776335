"""Which modules become tensor-parallel: registrations and the replacement pass (the marks themselves are
:mod:`smp2ds.engine.nn.parallel.marks`, re-exported here).

* Registrations: ``smp.tp_register`` / ``smp.tp_register_with_module`` name the distributed class
  for a module class, with SMP's ``init_hook`` / ``forward_hook`` / ``return_hook``; built in:
  ``nn.Linear`` -> ``smp.nn.DistributedLinear``, ``nn.Embedding`` -> ``smp.nn.DistributedEmbedding``.
* :func:`apply` (run by ``smp.DistributedModel``): top-down, the outermost marked module wins. A
  marked Hugging Face model or block with a sharding rule (:mod:`families`) is sharded in place,
  keeping its weights; a marked module of a registered class is replaced by its distributed
  class (fresh weights from ``tensor_parallel_seed``, as in SMP), unless it shares a parameter
  with another module, which stays whole.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.core.partitioned_params import Around
from smp2ds.engine.nn.parallel.context import ParallelContext, using
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.marks import Mark, mark_of
from smp2ds.engine.nn.parallel.modules import DistributedEmbedding, DistributedLinear
from smp2ds.engine.tensor_parallel import families, held_weights

INIT_ARGS = "_smp2ds_init_args"




@dataclass(frozen=True)
class Registration:
    dist_module: type
    init_hook: Callable | None = None
    forward_hook: Callable | None = None
    return_hook: Callable | None = None


_REGISTRY: dict[type, Registration] = {}


# ---- registrations ----------------------------------------------------------------------------
def _record_init_args(cls: type) -> None:
    """Wrap ``cls.__init__`` so instances remember their constructor arguments (for init_hook)."""
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, "_smp2ds_records", False):
        return

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        object.__setattr__(self, INIT_ARGS, (args, kwargs))

    init._smp2ds_records = True  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[misc]


def register(module_cls: type, dist_module: type, init_hook: Callable | None = None,
             forward_hook: Callable | None = None, return_hook: Callable | None = None) -> None:
    """Make ``dist_module`` the tensor-parallel version of ``module_cls``."""
    if not (isinstance(module_cls, type) and issubclass(module_cls, torch.nn.Module)):
        raise TypeError(f"tp_register_with_module: module_cls must be an nn.Module class, got {module_cls!r}")
    if not (isinstance(dist_module, type) and issubclass(dist_module, torch.nn.Module)):
        raise TypeError(f"tp_register: dist_module must be an nn.Module class (a smp.nn.DistributedModule), "
                        f"got {dist_module!r}")
    if module_cls not in (torch.nn.Linear, torch.nn.Embedding):
        _record_init_args(module_cls)
    _REGISTRY[module_cls] = Registration(dist_module, init_hook, forward_hook, return_hook)


def registration_for(cls: type) -> Registration | None:
    for klass in cls.__mro__:
        if klass in _REGISTRY:
            return _REGISTRY[klass]
    return None


def register_builtins() -> None:
    """SMP's built-in registrations (real classes from :mod:`modules`)."""
    _REGISTRY.setdefault(torch.nn.Linear, Registration(DistributedLinear))
    _REGISTRY.setdefault(torch.nn.Embedding, Registration(DistributedEmbedding))


def _builtin_args(module: torch.nn.Module) -> tuple[tuple, dict]:
    if isinstance(module, torch.nn.Linear):
        return (module.in_features, module.out_features), {"bias": module.bias is not None}
    if isinstance(module, torch.nn.Embedding):
        return (module.num_embeddings, module.embedding_dim), {
            "padding_idx": module.padding_idx, "max_norm": module.max_norm, "norm_type": module.norm_type,
            "scale_grad_by_freq": module.scale_grad_by_freq, "sparse": module.sparse}
    return getattr(module, INIT_ARGS, ((), {}))


# ---- the replacement pass ---------------------------------------------------------------------
@dataclass
class Report:
    """What :func:`apply` did (also kept on the model as ``_smp2ds_tp_report``)."""

    sharded_blocks: list[str] = field(default_factory=list)
    replaced: dict[str, str] = field(default_factory=dict)
    kept_shared: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)
    """Parameters of replaced modules that start from their distributed class's own init (Hugging Face's init
    skipped, or nothing held), by their names in the model."""


def sync_replicas(module: torch.nn.Module, tp: TPGroup) -> None:
    """Make every tensor-parallel rank start from the same weights (tp rank 0's): DeepSpeed only
    broadcasts inside the data-parallel (rdp) group. A parameter already partitioned by ZeRO-3
    (sharded data parallelism with delayed init) broadcasts its partition: tensor-parallel peers sit
    at the same place in their shard groups, so they hold the same piece."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            for tensor in (t.ds_tensor, t.data) if hasattr(t, "ds_tensor") else (t.data,):
                if tensor.numel() and not tensor.is_meta:  # meta: nothing held yet (delayed initialisation)
                    comm.broadcast(tensor, tp.src, group=tp.handle)


def _shared_params(root: torch.nn.Module) -> set[int]:
    owners: Counter[int] = Counter()
    for m in root.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] += 1
    return {pid for pid, count in owners.items() if count > 1}


def _replace(module: torch.nn.Module, reg: Registration, kwargs: dict[str, Any],
             context: ParallelContext) -> torch.nn.Module:
    args, init_kwargs = _builtin_args(module)
    if reg.init_hook is not None:
        args, init_kwargs = reg.init_hook(*args, **init_kwargs)
    weight = next(module.parameters(), None)
    # a registered class keeps SMP's signature: the smp.nn modules it builds take their group from `using`
    with using(context):
        new = reg.dist_module(*args, **{**init_kwargs, **_accepted(reg.dist_module, kwargs)})
    if weight is not None:
        new.to(device=weight.device, dtype=weight.dtype)
    new.train(module.training)
    if reg.forward_hook is not None:
        object.__setattr__(new, "_smp2ds_forward_hook", reg.forward_hook)
    if reg.return_hook is not None:
        object.__setattr__(new, "_smp2ds_return_hook", reg.return_hook)
    return new


def _accepted(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The marking context's keyword arguments the distributed class's constructor takes."""
    import inspect

    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def _as_is(module: torch.nn.Module) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def apply(root: torch.nn.Module, context: ParallelContext, around: Around | None = None) -> Report:
    """Shard or replace the marked modules of ``root`` in place over ``context``'s tensor-parallel group (see the
    module docstring).

    ``around(module)``, when given, wraps the sharding of each block and the placing of each
    replacement: parameters created partitioned (sharded data parallelism) are whole inside it
    and the new shards partitioned when it exits, so no rank holds more than one block whole."""
    around = around or _as_is
    tp = context.tp
    register_builtins()
    report = Report()
    marked = [m for m in root.modules() if (mark_of(m) or Mark(False)).enabled]
    if not marked:
        return report
    sync_replicas(root, tp)
    shared = _shared_params(root)
    hf_marks = held_weights.hf_marks(root)

    def visit(module: torch.nn.Module, prefix: str) -> None:
        mark = mark_of(module)
        if mark is not None and mark.enabled and list(families.blocks(module)):
            report.sharded_blocks += [f"{prefix}{n}".rstrip(".") for n in families.shard_model(module, tp, around)]
            return
        for name, child in list(module.named_children()):
            path = f"{prefix}{name}"
            child_mark = mark_of(child)
            reg = registration_for(type(child))
            if (child_mark is not None and child_mark.enabled and reg is not None
                    and not list(families.blocks(child))):
                if any(id(p) in shared for p in child.parameters()):
                    report.kept_shared.append(path)
                    warnings.warn(f"{path} shares a parameter with another module; it is not distributed "
                                  "(SMP's rule)", stacklevel=4)
                    continue
                if reg.dist_module.__dict__.get("can_distribute") is not None and not \
                        reg.dist_module.can_distribute(*_builtin_args(child)[0], **_builtin_args(child)[1]):
                    visit(child, path + ".")
                    continue
                with around(child):
                    values = held_weights.held(child, hf_marks)
                from_hf = any(hf_marks.get(id(p), False) for p in child.parameters())
                new = _replace(child, reg, child_mark.kwargs, context)
                kept = held_weights.carry_into(new, values, tp.rank, path=path, from_hf_model=from_hf)
                report.fresh += [f"{path}.{n}" for n, _ in new.named_parameters() if not kept or n not in values]
                with around(new):
                    setattr(module, name, new)
                report.replaced[path] = type(getattr(module, name)).__name__
                continue
            visit(child, path + ".")

    visit(root, "")
    object.__setattr__(root, "_smp2ds_tp_report", report)
    return report
