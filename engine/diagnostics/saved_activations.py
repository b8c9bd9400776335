"""The activations autograd keeps for backward, counted while a function runs.

``saved_activations(fn, exclude)`` runs ``fn()`` under ``torch.autograd.graph.saved_tensors_hooks`` and
lists every storage a saved tensor lives in once (views of one storage count once), leaving out the
storages of ``exclude`` (a module's parameters: saved, but not activations). Used to compare the
tensor-parallel layouts (``optimize: speed`` / ``memory``) in tests and ``bench/``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def saved_activations(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> tuple[list, Any]:
    """``([(shape, bytes), ...], fn())``: each storage autograd saved during ``fn()``, with the shape of the
    first tensor seen in it, except those of ``exclude``."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, tuple[tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = (tuple(t.shape), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return list(storages.values()), result


def split_bytes(saved: list, hidden: int) -> tuple[int, int]:
    """Bytes of the entries shaped like hidden states (last dimension ``hidden``, or 1: layer-norm
    statistics) and of the others."""
    tokens = sum(b for shape, b in saved if shape and shape[-1] in (hidden, 1))
    return tokens, sum(b for _, b in saved) - tokens
