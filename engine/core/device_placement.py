"""SMP's device placement of ``@smp.step`` inputs: the tensors a step receives go to the model's device.

SMP put the model on ``cuda:local_rank()`` and moved the tensors passed to an ``@smp.step``
function there, so SMP scripts hand their steps CPU batches. DeepSpeed puts the model on its
accelerator's device for this process (``engine.device``: ``cuda:LOCAL_RANK``, the device
``smp.init`` selects with ``torch.cuda.set_device``); ``DistributedModel.run_step`` moves the
step's arguments there with :func:`to_device` before they are cut into micro-batches, so every
micro-batch slice is a view on the device (one copy per tensor and step, not one per slice).

The rules, for every tensor inside the arguments (positional, keyword, ``non_split_inputs``,
nested in lists, tuples, named tuples, sets, dicts and other mappings such as a tokenizer's
``BatchEncoding``):

* on the CPU: copied to the model's device, as SMP did, also when a script passes a CPU tensor
  on purpose (a step that needs a host tensor gets it with ``.cpu()`` inside the function);
  asynchronous (``non_blocking``) when the source is pinned memory (:func:`copies_async`), since
  then the copy is ordered on the device stream before the step's kernels that read it;
* already on the model's device: passed as it is (the same object, no copy);
* on any other device (a GPU other than this rank's, ...): :class:`SMPInvalidArgumentError`
  naming the argument, its device and the model's, instead of a device mismatch deep inside the
  model's forward.

Containers are rebuilt like the micro-batch split rebuilds them, and kept as they are (the same
object) when nothing inside moved. Other objects (the model, an optimizer, a ``StepOutput``,
objects with ``smp_slice``) are passed untouched. When the model runs on the CPU (DeepSpeed's
CPU accelerator), :func:`step_input_device` is ``None`` and nothing is traversed or copied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from smp2ds.engine.core.microbatch_split import rebuild_mapping, rebuild_sequence
from smp2ds.engine.exceptions import SMPInvalidArgumentError

_CONTAINERS = (Mapping, list, tuple, set, frozenset)


def device_for(accelerator: str, local_rank: int) -> torch.device | None:
    """The device DeepSpeed places this process's model on, for accelerator type ``accelerator``
    (``get_accelerator().device_name()``: ``"cuda"``, ``"cpu"``, ...); ``None`` for the CPU, where
    there is nothing to move."""
    if accelerator == "cpu":
        return None
    return torch.device(accelerator, local_rank)


def step_input_device(local_rank: int, pp_rank: int) -> torch.device | None:
    """Where this rank's ``@smp.step`` inputs go; ``None``: leave them alone.

    Pipeline stages after the first never use their own step arguments (they run with the first
    stage's, received on the engine's device; see ``smp2ds.engine.pipeline.step_inputs``), so only
    ``pp_rank`` 0 moves its inputs.
    """
    if pp_rank != 0:
        return None
    from deepspeed.accelerator import get_accelerator

    return device_for(get_accelerator().device_name(), local_rank)


def needs_copy(source: torch.device, target: torch.device, where: str) -> bool:
    """True when a tensor on ``source`` is to be copied to ``target`` (it is on the CPU); False when
    it is there already; an error for any other device."""
    if source == target:
        return False
    if source.type == "cpu":
        return True
    raise SMPInvalidArgumentError(
        f"{where} is a tensor on {source}, but the model runs on {target}: an smp.step function takes "
        f"tensors on the CPU (moved to {target}) or on {target}; move it there (torch.cuda.set_device("
        f"smp.local_rank()), then .to(torch.device('cuda'))) or pass it on the CPU"
    )


def copies_async(t: torch.Tensor) -> bool:
    """``non_blocking`` for copying the CPU tensor ``t`` to the device: only pinned memory can be
    copied asynchronously (from pageable memory a non-blocking copy is synchronous anyway)."""
    return t.is_pinned()


def to_device(obj: Any, device: torch.device, where: str = "step argument") -> Any:
    """``obj`` with every tensor on ``device`` (see the module docstring); ``where`` names ``obj`` in
    error messages."""
    if isinstance(obj, torch.Tensor):
        if needs_copy(obj.device, device, where):
            return obj.to(device, non_blocking=copies_async(obj))
        return obj
    if not isinstance(obj, _CONTAINERS) or hasattr(obj, "smp_slice"):
        # Other objects (the model: no hasattr on it, nn.Module's miss is slow) and containers that
        # slice themselves per micro-batch (as in the split) are not ours to rebuild.
        return obj
    changed = False
    if isinstance(obj, Mapping):
        items = {}
        for k, v in obj.items():
            items[k] = moved = to_device(v, device, f"{where}[{k!r}]")
            changed = changed or moved is not v
        return rebuild_mapping(obj, items) if changed else obj
    values = []
    for i, v in enumerate(obj):
        values.append(moved := to_device(v, device, f"{where}[{i}]"))
        changed = changed or moved is not v
    return rebuild_sequence(obj, values) if changed else obj


def arguments_to_device(names: Sequence[str], args: tuple, kwargs: dict[str, Any],
                        device: torch.device) -> tuple[tuple, dict[str, Any]]:
    """A step call's positional and keyword arguments with their tensors on ``device``; ``names``
    are the positional parameters' names (for error messages)."""
    new_args = tuple(to_device(v, device, f"argument {name!r}") for v, name in zip(args, names))
    new_kwargs = {k: to_device(v, device, f"argument {k!r}") for k, v in kwargs.items()}
    return new_args, new_kwargs
