"""Split the arguments of an ``@smp.step`` call into micro-batches (SMP semantics).

Every tensor — positional or keyword, also inside lists, tuples, dicts and sets — is cut along
``input_split_axes.get(arg_name, 0)`` into ``n`` equal views with ``narrow``. Arguments named
in ``non_split_inputs`` go whole to every micro-batch; objects with ``smp_slice(n, i, axis)``
slice themselves; a ``StepOutput`` contributes its i-th output; anything else is shared.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from smp2ds.engine.core.step_output import StepOutput
from smp2ds.engine.exceptions import TensorSplitError

Piece = tuple[tuple[Any, ...], dict[str, Any]]


def check_spec(non_split_inputs: Any, input_split_axes: Any) -> tuple[frozenset[str], dict[str, int]]:
    """Validate the decorator arguments (SMP raises ``TensorSplitError`` for bad ones)."""
    if non_split_inputs is None:
        names: frozenset[str] = frozenset()
    elif isinstance(non_split_inputs, (list, tuple)) and all(isinstance(n, str) for n in non_split_inputs):
        names = frozenset(non_split_inputs)
    else:
        raise TensorSplitError(f"non_split_inputs must be a list of argument names, got {non_split_inputs!r}")
    if input_split_axes is None:
        axes: dict[str, int] = {}
    elif isinstance(input_split_axes, dict) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in input_split_axes.items()
    ):
        axes = dict(input_split_axes)
    else:
        raise TensorSplitError(
            f"input_split_axes must be a dict of argument name -> axis (int), got {input_split_axes!r}"
        )
    return names, axes


def _split_tensor(t: torch.Tensor, n: int, axis: int, where: str) -> list[torch.Tensor]:
    if t.dim() == 0:
        raise TensorSplitError(f"cannot split {where}: it is a 0-dimensional tensor; list it in non_split_inputs")
    if not -t.dim() <= axis < t.dim():
        raise TensorSplitError(
            f"cannot split {where} along axis {axis}: it has only {t.dim()} dimension(s) "
            f"(shape {tuple(t.shape)}); fix input_split_axes"
        )
    length = t.shape[axis]
    if length % n:
        raise TensorSplitError(
            f"cannot split {where} into microbatches={n}: dimension {axis} has size {length} (shape "
            f"{tuple(t.shape)}), not divisible by {n}; use a per-rank batch that is a multiple of {n} "
            f"(e.g. DataLoader(drop_last=True)), change input_split_axes, or list it in non_split_inputs"
        )
    size = length // n
    return [t.narrow(axis, i * size, size) for i in range(n)]


_SHARED_WARNED: set[type] = set()


def _warn_shared(value: Any, where: str) -> None:
    kind = type(value)
    if kind in _SHARED_WARNED:
        return
    if isinstance(value, (torch.optim.Optimizer, torch.utils.data.DataLoader, torch.utils.data.Dataset)) or type(
        value
    ).__name__.endswith(("LRScheduler", "LR")):
        _SHARED_WARNED.add(kind)
        warnings.warn(
            f"{where} ({kind.__name__}) is passed whole to every micro-batch of the smp.step function; "
            "optimizers, schedulers and data loaders belong outside it",
            stacklevel=5,
        )


def split_value(value: Any, n: int, axis: int, where: str) -> list[Any]:
    """``n`` micro-batch versions of ``value``."""
    if isinstance(value, torch.Tensor):
        return _split_tensor(value, n, axis, where)
    if isinstance(value, StepOutput):
        if len(value.outputs) != n:
            raise TensorSplitError(f"{where} is a StepOutput with {len(value.outputs)} outputs, expected {n}")
        return list(value.outputs)
    if hasattr(value, "smp_slice") and callable(value.smp_slice):
        return [value.smp_slice(n, i, axis) for i in range(n)]
    if isinstance(value, Mapping):
        parts = {k: split_value(v, n, axis, f"{where}[{k!r}]") for k, v in value.items()}
        return [rebuild_mapping(value, {k: p[i] for k, p in parts.items()}) for i in range(n)]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
        parts_l = [split_value(v, n, axis, f"{where}[{j}]") for j, v in enumerate(items)]
        return [rebuild_sequence(value, [p[i] for p in parts_l]) for i in range(n)]
    _warn_shared(value, where)
    return [value] * n


def rebuild_mapping(template: Mapping, items: dict) -> Any:
    """A mapping of ``template``'s type holding ``items`` (a plain dict if that type cannot be built so)."""
    try:
        return type(template)(items)
    except Exception:  # noqa: BLE001 - mapping types whose constructor differs: fall back to dict
        return dict(items)


def rebuild_sequence(template: Any, items: list) -> Any:
    """A list, tuple, named tuple or set of ``template``'s type holding ``items`` (else a list)."""
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*items)  # namedtuple
    try:
        return type(template)(items)
    except Exception:  # noqa: BLE001
        return list(items)


def positional_names(func: Callable[..., Any], count: int) -> list[str]:
    """Parameter names of the first ``count`` positional arguments (``*args`` elements share its name)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for p in params:
        if len(names) >= count:
            break
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            names.extend([p.name] * (count - len(names)))
        elif p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    names.extend(f"argument {i}" for i in range(len(names), count))
    return names


def split_call(
    func: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    n: int,
    non_split: frozenset[str],
    axes: Mapping[str, int],
) -> list[Piece]:
    """Per-micro-batch ``(args, kwargs)`` for calling ``func``, keeping the call's shape."""
    return split_named(positional_names(func, len(args)), args, kwargs, n, non_split, axes)


def split_named(
    names: Sequence[str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    n: int,
    non_split: frozenset[str],
    axes: Mapping[str, int],
) -> list[Piece]:
    """``split_call`` with the positional parameter names already known."""
    arg_parts = [_split_named(v, name, n, non_split, axes) for v, name in zip(args, names)]
    kw_parts = {k: _split_named(v, k, n, non_split, axes) for k, v in kwargs.items()}
    return [(tuple(p[i] for p in arg_parts), {k: p[i] for k, p in kw_parts.items()}) for i in range(n)]


def _split_named(value: Any, name: str, n: int, non_split: frozenset[str], axes: Mapping[str, int]) -> list[Any]:
    if name in non_split:
        return [value] * n
    return split_value(value, n, axes.get(name, 0), f"argument {name!r}")
