"""The parallel context ``smp.nn``'s building blocks are built in: this rank's tensor-parallel group (its torch
handle, rank, size, members, batch mode and random stream) and the pipeline degree.

``smp.init`` builds one from its process groups (:func:`from_groups`) and installs it. The engine hands it
explicitly to everything it builds: the tensor-parallel pass, SMP's distributed transformer, the pipeline's
layer lists, each ``smp.nn`` layer to its sub-layers. Once built, a module keeps its group (``module.tp``) and
never looks it up again.

The public ``smp.nn`` constructors keep SMP's signatures, in which the group is implicit, so they take the
context as an extra keyword, ``parallel_context=``. Without it they resolve the *active* context, in this
order: the innermost :func:`using` block (the engine builds a script's registered distributed classes in one),
the context ``smp.init`` installed, the single-process context (no tensor parallelism). :func:`resolve` is that
rule's only home.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from smp2ds.engine.nn.parallel.group import SINGLE, TPGroup, groups_of
from smp2ds.engine.nn.parallel.rng import RngManager
from smp2ds.translator.tensor_parallel import TensorParallelSettings

if TYPE_CHECKING:  # the annotation only: smp.init hands the groups in
    from smp2ds.engine.core.process_groups import ProcessGroups


@dataclass(frozen=True)
class ParallelContext:
    """What a building block needs of the layout: its tensor-parallel group and the pipeline degree."""

    tp: TPGroup = SINGLE
    pipeline_stages: int = 1


def from_groups(groups: ProcessGroups, settings: TensorParallelSettings) -> ParallelContext:
    """This rank's context under ``smp.init``'s process groups and the Plan's tensor-parallel settings (a fresh
    random stream from ``tensor_parallel_seed``)."""
    stream = RngManager(settings.seed)
    topology = groups.topology
    if topology.tp == 1:
        tp = dataclasses.replace(SINGLE, rng=stream)
    else:
        tp = TPGroup(handle=groups.group("tp"), rank=groups.coords.tp_rank, size=topology.tp,
                     ranks=tuple(groups.ranks["tp"]), prescaled_batch=settings.prescaled_batch,
                     optimize=settings.optimize, rng=stream)
    return ParallelContext(tp=tp, pipeline_stages=topology.pp)


class _Contexts:
    """The installed context and the stack of :func:`using` blocks (one set per process)."""

    def __init__(self) -> None:
        self.installed: ParallelContext | None = None
        self.scoped: list[ParallelContext] = []
        self.single = ParallelContext()


_contexts = _Contexts()


def install(context: ParallelContext) -> None:
    """Make ``context`` the process's (``smp.init``)."""
    _contexts.installed = context


def forget() -> None:
    """Drop the installed context (the process groups are gone)."""
    _contexts.installed = None


def installed() -> ParallelContext:
    """The context ``smp.init`` installed; RuntimeError before it."""
    if _contexts.installed is None:
        raise RuntimeError("no parallel context: smp.init() has not run in this process")
    return _contexts.installed


def restart_streams() -> ParallelContext:
    """Start the process's random streams afresh from their seeds (``smp.reset()``: the distributed modules of the
    next model draw the weights the first model's drew); returns the active context."""
    def restarted(context: ParallelContext) -> ParallelContext:
        return dataclasses.replace(context, tp=dataclasses.replace(context.tp, rng=RngManager(context.tp.rng.seed)))

    if _contexts.installed is not None:
        _contexts.installed = restarted(_contexts.installed)
    _contexts.single = restarted(_contexts.single)
    return resolve()


@contextlib.contextmanager
def using(context: ParallelContext) -> Iterator[ParallelContext]:
    """Build the body's ``smp.nn`` modules in ``context`` (those not given one explicitly)."""
    _contexts.scoped.append(context)
    try:
        yield context
    finally:
        _contexts.scoped.pop()


def resolve(context: ParallelContext | None = None) -> ParallelContext:
    """``context`` when given, else the active one (innermost :func:`using`, installed, single process)."""
    if context is not None:
        return context
    if _contexts.scoped:
        return _contexts.scoped[-1]
    return _contexts.installed if _contexts.installed is not None else _contexts.single


def built_for_another_group(root: torch.nn.Module, context: ParallelContext) -> list[str]:
    """Names of ``root``'s modules built over a tensor-parallel group other than ``context``'s (an ``smp.nn`` module
    made before ``smp.init``, or for another layout): such a module would compute as a single process, or over
    the wrong ranks, without any error of its own."""
    wanted = (context.tp.size, context.tp.ranks)
    return [name or type(module).__name__ for name, module in root.named_modules()
            if any((group.size, group.ranks) != wanted for group in groups_of(module))]
