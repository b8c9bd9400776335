"""Tagging the modules created inside a context: ``smp.partition(i)`` (the pipeline stage) and
``smp.tensor_parallelism()`` (the tensor-parallel mark) both give every module built inside them the innermost
open context's value.

Creation is observed by wrapping ``torch.nn.Module.__init__``, which every module runs first thing in its
constructor, parameterless ones included. One wrapper serves every kind of tag: it is installed when the first
context of any kind opens and removed when the last one closes, so contexts of different kinds may nest and close
in any order, and no module is built through a wrapper outside them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from torch import nn

T = TypeVar("T")

_lock = threading.RLock()
_original_init: Callable[..., None] | None = None
_open: list[CreationTag[Any]] = []  # the kinds of tag with a context open, in the order they opened


class CreationTag(Generic[T]):
    """One kind of tag: ``record(module, value)`` is called for each module created while a context is open, with
    the innermost context's value."""

    def __init__(self, record: Callable[[nn.Module, T], None]) -> None:
        self._record = record
        self._stack: list[T] = []

    @property
    def current(self) -> T | None:
        """The value modules created now receive (the innermost open context's), or None."""
        return self._stack[-1] if self._stack else None

    @contextlib.contextmanager
    def around(self, value: T) -> Iterator[None]:
        """Modules created inside receive ``value`` (nested contexts of this kind override it)."""
        with _lock:
            if not self._stack:
                _open.append(self)
            self._stack.append(value)
            _install()
        try:
            yield
        finally:
            with _lock:
                self._stack.pop()
                if not self._stack:
                    _open.remove(self)
                if not _open:
                    _uninstall()


def _tagging_init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    assert _original_init is not None  # installed with it
    _original_init(self, *args, **kwargs)
    for tag in tuple(_open):
        value = tag.current
        if value is not None:
            tag._record(self, value)


def _install() -> None:
    global _original_init
    if _original_init is None:
        _original_init = nn.Module.__init__
        nn.Module.__init__ = _tagging_init  # type: ignore[method-assign]


def _uninstall() -> None:
    global _original_init
    if _original_init is not None:
        nn.Module.__init__ = _original_init  # type: ignore[method-assign]
        _original_init = None
