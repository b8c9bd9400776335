"""Manual stage assignment: ``smp.partition(i)`` and ``smp.set_partition(module, i)``.

SMP semantics (docs/smp-semantics.md#pipelines): modules *created* inside ``with smp.partition(i):``
belong to partition ``i`` (innermost context wins); ``set_partition`` assigns an existing module
and, by default, its children; modules outside any context follow their nearest assigned
ancestor, else ``default_partition``. Both only take effect with ``auto_partition: false``.

Creation is observed by :mod:`smp2ds.engine.core.module_creation` (a wrapper of ``torch.nn.Module.__init__``
while a context is open): a module is tagged with the innermost open context at the moment it is created,
parameterless ones included. Tags live in weak dictionaries, so they never keep a module alive.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from torch import nn

from smp2ds.engine.core.module_creation import CreationTag
from smp2ds.engine.exceptions import InvalidPartitionIDError

_context_tags: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_explicit: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()
_num_stages: int | None = None


def configure(num_stages: int | None) -> None:
    """Tell the registry how many stages exist, so out-of-range indices fail immediately.

    The engine calls this from ``smp.init`` (``None`` turns the check off again).
    """
    global _num_stages
    _num_stages = num_stages


def _check_index(index: object) -> int:
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise InvalidPartitionIDError(f"partition index must be an int >= 0, got {index!r}")
    if _num_stages is not None and index >= _num_stages:
        raise InvalidPartitionIDError(
            f"partition index {index} is out of range: pipeline_parallel_degree is {_num_stages}, "
            f"so partitions are 0..{_num_stages - 1}")
    return index


def _tag(module: nn.Module, index: int) -> None:
    if module not in _context_tags:
        _context_tags[module] = index


_PARTITION = CreationTag(_tag)


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Context manager: modules created inside go to pipeline partition ``index``."""
    with _PARTITION.around(_check_index(index)):
        yield


def set_partition(module: nn.Module, index: int, recurse: bool = True) -> None:
    """Assign ``module`` (and with ``recurse`` all its descendants) to partition ``index``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_partition expects a torch.nn.Module, got {type(module).__name__}")
    index = _check_index(index)
    targets = module.modules() if recurse else [module]
    for m in targets:
        _explicit[m] = index


def assigned(module: nn.Module) -> int | None:
    """The partition given to this very module (set_partition beats a context), else None."""
    if module in _explicit:
        return _explicit[module]
    return _context_tags.get(module)


def effective_partitions(root: nn.Module, default: int) -> dict[int, int]:
    """``id(module) -> partition`` for every module under ``root`` (inherit from the parent)."""
    out: dict[int, int] = {}

    def visit(module: nn.Module, inherited: int) -> None:
        own = assigned(module)
        part = inherited if own is None else own
        if id(module) in out:
            return
        out[id(module)] = part
        for child in module.children():
            visit(child, part)

    visit(root, default)
    return out


def clear() -> None:
    """Forget every assignment (tests and ``smp.reset``)."""
    _context_tags.clear()
    _explicit.clear()
