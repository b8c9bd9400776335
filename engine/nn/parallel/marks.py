"""Which modules become tensor-parallel: SMP's marks.

``smp.tensor_parallelism(enabled, **kwargs)`` marks every module *created* inside it (nested contexts override),
``smp.set_tensor_parallelism(module, enabled, **kwargs)`` marks an existing tree, and
``model_creation(tensor_parallelism=True)`` enters the first. The tensor-parallel package reads the marks when
it shards a model; distributed modules mark their own trees off (:func:`keep_whole`), since they are
distributed already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from smp2ds.engine.core.module_creation import CreationTag

MARK = "_smp2ds_tp_mark"


@dataclass(frozen=True)
class Mark:
    enabled: bool
    kwargs: dict[str, Any] = field(default_factory=dict)


def _mark(module: torch.nn.Module, mark: Mark) -> None:
    object.__setattr__(module, MARK, mark)


_CREATED = CreationTag(_mark)


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Mark modules created inside for tensor parallelism (innermost context wins)."""
    with _CREATED.around(Mark(bool(enabled), dict(kwargs))):
        yield


def set_tensor_parallelism(module: torch.nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Mark (or unmark) ``module`` and every module below it."""
    mark = Mark(bool(enabled), dict(kwargs))
    for m in module.modules():
        object.__setattr__(m, MARK, mark)


def mark_of(module: torch.nn.Module) -> Mark | None:
    return getattr(module, MARK, None)


def active() -> Mark | None:
    """The mark modules created now receive (the innermost ``tensor_parallelism`` context), or None."""
    return _CREATED.current


def keep_whole(module: torch.nn.Module) -> None:
    """Mark ``module`` alone (not its children) as not tensor-parallel: the sharding pass leaves it as it is."""
    object.__setattr__(module, MARK, Mark(False))
