"""Which modules become tensor-parallel: SMP's marks.

``smp.tensor_parallelism(enabled, **kwargs)`` marks every module *created* inside it (nested contexts override),
``smp.set_tensor_parallelism(module, enabled, **kwargs)`` marks an existing tree, and
``model_creation(tensor_parallelism=True)`` enters the first. The tensor-parallel package reads the marks when
it shards a model; distributed modules mark their own trees off (:func:`keep_whole`), since they are
distributed already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

MARK = "_smp2ds_tp_mark"


@dataclass(frozen=True)
class Mark:
    enabled: bool
    kwargs: dict[str, Any] = field(default_factory=dict)


_STACK: list[Mark] = []
_ORIGINAL_INIT: list[Callable] = []


def _marking_init(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    _ORIGINAL_INIT[0](self, *args, **kwargs)
    if _STACK:
        object.__setattr__(self, MARK, _STACK[-1])


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Mark modules created inside for tensor parallelism (innermost context wins)."""
    if not _STACK:
        _ORIGINAL_INIT.append(torch.nn.Module.__init__)
        torch.nn.Module.__init__ = _marking_init  # type: ignore[method-assign]
    _STACK.append(Mark(bool(enabled), dict(kwargs)))
    try:
        yield
    finally:
        _STACK.pop()
        if not _STACK:
            torch.nn.Module.__init__ = _ORIGINAL_INIT.pop()  # type: ignore[method-assign]


def set_tensor_parallelism(module: torch.nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Mark (or unmark) ``module`` and every module below it."""
    mark = Mark(bool(enabled), dict(kwargs))
    for m in module.modules():
        object.__setattr__(m, MARK, mark)


def mark_of(module: torch.nn.Module) -> Mark | None:
    return getattr(module, MARK, None)


def active() -> Mark | None:
    """The mark modules created now receive (the innermost ``tensor_parallelism`` context), or None."""
    return _STACK[-1] if _STACK else None


def keep_whole(module: torch.nn.Module) -> None:
    """Mark ``module`` alone (not its children) as not tensor-parallel: the sharding pass leaves it as it is."""
    object.__setattr__(module, MARK, Mark(False))
