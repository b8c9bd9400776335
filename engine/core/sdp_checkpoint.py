"""SMP's sharded-data-parallel checkpoint layout: what each file holds, for the writer and both readers.

``smp.save_checkpoint(partial=True)`` under sharded data parallelism (tensor- and pipeline-parallel degree 1)
writes ``<path>/<tag>/`` (names in :mod:`checkpoint_format`):

* ``model_0.pt``: ``{"module": state dict}``. smp2ds stores every tensor whole (gathered over the shard group),
  plus SMP's partial markers beside ``module``. SMP itself stored DeepSpeed ZeRO-3's module state: buffers whole
  and each partitioned parameter as an empty placeholder; the weights then live only in the optimizer files.
* ``optimizer_<s>.pt``, one per shard rank ``s`` of the first shard group (the other groups hold the same state):
  DeepSpeed's ZeRO-3 ``state_dict()`` at the top level (``partition_count``, ``fp32_flat_groups``,
  ``optimizer_state_dict``, the loss scaler), and under smp2ds an added ``"smp2ds"`` entry (ZeRO stage,
  precision, data-parallel coordinates) that DeepSpeed and SMP's helper ignore.

Pure transformations of loaded objects, plus :func:`is_sdp_dir` (one ``os.path`` check).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from smp2ds.engine.core import checkpoint_format as fmt

ENGINE_META = "smp2ds"
ENGINE_OPTIMIZER = "ds_optimizer"
"""Where smp2ds's own optimizer files nest DeepSpeed's state dict (``DistributedOptimizer.local_state_dict``)."""


def is_sdp_dir(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint in SMP's sharded-data-parallel layout."""
    return os.path.isfile(os.path.join(directory, fmt.SDP_MODEL))


def model_body(local_state_dict: dict[str, Any]) -> dict[str, Any]:
    """``model_0.pt``'s content from ``DistributedModel.local_state_dict()``: tensors under ``module``, SMP's
    markers beside it."""
    markers = {k: v for k, v in local_state_dict.items() if k in fmt.MARKERS}
    return {fmt.SDP_MODULE: {k: v for k, v in local_state_dict.items() if k not in fmt.MARKERS}, **markers}


def split_module(obj: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the whole tensors of ``model_0.pt``'s ``module``, the names of its empty placeholders).

    A placeholder is what ZeRO-3's ``state_dict`` leaves for a partitioned parameter (a tensor with no elements):
    its value is in the optimizer files' master weights.
    """
    module = obj.get(fmt.SDP_MODULE) if isinstance(obj, dict) else None
    if not isinstance(module, dict):
        raise ValueError(f"no {fmt.SDP_MODULE!r} state dict (SMP's sharded-data-parallel model file holds one)")
    whole = {k: v for k, v in module.items() if isinstance(v, torch.Tensor) and v.numel() > 0}
    empty = [k for k, v in module.items() if isinstance(v, torch.Tensor) and v.numel() == 0]
    return whole, empty


def optimizer_body(ds_state: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """``optimizer_<s>.pt``'s content: DeepSpeed's state dict at the top level, smp2ds's facts beside it."""
    return {**ds_state, ENGINE_META: meta}


def zero_stage_of(ds_state: dict[str, Any]) -> int:
    """The ZeRO stage DeepSpeed recorded in its state dict (an enum, an int, or absent: 0)."""
    return int(ds_state.get("zero_stage", 0))


def partition_count(ds_state: dict[str, Any]) -> int:
    """Over how many ranks DeepSpeed partitioned this state (a list per group in some versions: the largest)."""
    count = ds_state.get("partition_count", 1)
    return int(max(count)) if isinstance(count, (list, tuple)) else int(count)


def engine_optimizer_state(obj: dict[str, Any]) -> dict[str, Any]:
    """What ``DistributedOptimizer.load_state_dict`` takes, from an optimizer file of either writer.

    smp2ds's files are returned as they are; a file SMP wrote (DeepSpeed's dict alone) is wrapped, its ZeRO
    stage read from DeepSpeed's own record.
    """
    if ENGINE_OPTIMIZER in obj:
        return obj
    meta = obj.get(ENGINE_META)
    ds_state = {k: v for k, v in obj.items() if k != ENGINE_META}
    if not isinstance(meta, dict):
        meta = {"zero_stage": zero_stage_of(ds_state)}
    return {ENGINE_OPTIMIZER: ds_state, ENGINE_META: meta, fmt.PARTIAL_MARK: True}
