"""``StepOutput``: the per-micro-batch values of one tensor returned by an ``@smp.step`` function."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


class StepOutput:
    """The i-th entry is what the step function returned for micro-batch i."""

    def __init__(self, outputs: list[Any] | None = None):
        self._outputs: list[Any] = list(outputs or [])

    @property
    def outputs(self) -> list[Any]:
        """The per-micro-batch tensors."""
        return self._outputs

    def reduce_mean(self) -> torch.Tensor:
        """``sum(outputs) / len(outputs)`` (the mini-batch mean of per-micro-batch means)."""
        return self.reduce_sum() / len(self._outputs)

    def reduce_sum(self) -> torch.Tensor:
        total = self._outputs[0]
        for value in self._outputs[1:]:
            total = total + value
        return total

    def concat(self) -> torch.Tensor:
        """``torch.cat(outputs, dim=0)``."""
        return torch.cat(self._outputs, dim=0)

    def stack(self) -> torch.Tensor:
        """``torch.stack(outputs)`` (new leading micro-batch dimension)."""
        return torch.stack(self._outputs)

    def detach(self) -> StepOutput:
        """A ``StepOutput`` of the detached outputs (Hugging Face's ``smp_nested_concat`` calls
        ``output.detach().concat()``)."""
        return StepOutput([o.detach() if isinstance(o, torch.Tensor) else o for o in self._outputs])

    def map(self, func: Callable[[Any], Any]) -> StepOutput:
        """Apply ``func`` to every output in place; returns self."""
        self._outputs = [func(o) for o in self._outputs]
        return self

    process_outputs = map

    def add_output(self, output: Any) -> None:
        self._outputs.append(output)

    def clear(self) -> None:
        self._outputs = []

    def __getitem__(self, index: int) -> Any:
        return self._outputs[index]

    def __len__(self) -> int:
        return len(self._outputs)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._outputs)

    def __repr__(self) -> str:
        return f"StepOutput({self._outputs!r})"


def collect(results: list[Any], detach: bool = True) -> Any:
    """Turn per-micro-batch return values into one value of the same structure.

    Tensors become ``StepOutput``; tuples, lists, dicts and Hugging Face ``ModelOutput`` are
    traversed; any other leaf becomes a plain list over micro-batches.
    """
    first = results[0]
    if isinstance(first, torch.Tensor):
        return StepOutput([r.detach() if detach else r for r in results])
    if hasattr(first, "to_tuple") and isinstance(first, Mapping):
        # HF ModelOutput: build empty then set fields, because its constructor interprets a lone
        # non-tensor first field as an iterable of (key, value) pairs.
        out = type(first)()
        for key in first:
            out[key] = collect([r[key] for r in results], detach)
        return out
    if isinstance(first, Mapping):
        items = {k: collect([r[k] for r in results], detach) for k in first}
        try:
            return type(first)(items)
        except Exception:  # noqa: BLE001 - mapping types with other constructors
            return items
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(collect([r[i] for r in results], detach) for i in range(len(first))))
    if isinstance(first, (tuple, list)):
        return type(first)(collect([r[i] for r in results], detach) for i in range(len(first)))
    return list(results)
