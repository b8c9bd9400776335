"""ZeRO-1 optimizer partitions (``shard_optimizer_state``) <-> Adam state per parameter.

With ``shard_optimizer_state`` every rdp rank's ``optimizer_states_<pp>_<tp>_<rdp>.pt`` holds
DeepSpeed ZeRO-1's ``state_dict()``: the parameters of the (single) parameter group flattened one
after another into one buffer, padded to a multiple of ``2 x rdp`` elements and cut into rdp equal
partitions, so a parameter may straddle two ranks. Each file holds its partition's fp32 master
weights (``single_partition_of_fp32_groups``, the last rank's padding left out), Adam's moments over
the padded partition (``base_optimizer_state``) and, per parameter it touches, where its fragment
starts (``param_slice_mappings``, by parameter name): the names in the order they appear over the
ranks give the flattening order. The master weights cut back out must equal the model file's
weights bit for bit, else the files are refused by name (:func:`.zero_partitions.per_parameter`).

Refused: more than one parameter group, DeepSpeed's per-parameter alignment padding, and a
partition count that is not the number of files.
"""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.checkpoint_tools.zero_partitions import per_parameter, read_zero, split_entry
from smp2ds.engine.exceptions import SMPCheckpointError, SMPUnsupportedError

MASTER = "single_partition_of_fp32_groups"
BASE = "base_optimizer_state"
MAPPINGS = "param_slice_mappings"
ALIGNMENT = 2
"""DeepSpeed's ``nccl_start_alignment_factor``: the flat buffer is padded to a multiple of it x rdp."""


def read(file: str, count: int) -> dict[str, Any]:
    """The ZeRO-1 state dict of one rank's file, refused by name unless fp32 ZeRO-1 over ``count`` ranks,
    one parameter group, no per-parameter padding."""
    sd = read_zero(file, 1)
    if not isinstance(sd.get(BASE), dict) or MASTER not in sd or MAPPINGS not in sd:
        raise SMPCheckpointError(f"{file}: not a ZeRO-1 optimizer state dict (no {BASE} / {MASTER} / {MAPPINGS}; "
                                 "elastic ZeRO checkpoints are not read)")
    groups = len(sd[BASE]["param_groups"])
    if groups != 1 or len(sd[MASTER]) != 1:
        raise SMPUnsupportedError(f"{file}: {groups} optimizer parameter groups under shard_optimizer_state; "
                                  "allowed: one parameter group")
    if list(sd.get("partition_count", [count])) != [count]:
        raise SMPCheckpointError(f"{file}: partitioned over {sd.get('partition_count')} ranks, but the checkpoint "
                                 f"has {count} reduced-data-parallel ranks")
    if any(any(pads) for pads in sd.get("param_alignment_paddings", [])):
        raise SMPUnsupportedError(f"{file}: DeepSpeed padded parameters inside the flat buffer "
                                  "(zero_optimization.parameter_alignment); allowed: unpadded parameters")
    return sd


def unflatten(files: list[str], tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: Adam state}`` of one stage and tensor-parallel rank from its rdp ranks' ``files`` (in
    rank order). ``tensors``: the same rank's model-file weights; ``names``: its parameters."""
    parts = [read(f, len(files)) for f in files]
    order = list(dict.fromkeys(n for sd in parts for n in sd[MAPPINGS][0]))
    if sorted(order) != sorted(names):
        raise SMPCheckpointError(
            f"{files[0]}: the optimizer partitions name the parameters {sorted(set(order) ^ set(names))[:4]} that "
            "the model file does not hold (or miss them): the files are of different saves or models")
    masters = [sd[MASTER][0].reshape(-1) for sd in parts]
    first = parts[0][BASE]["param_groups"][0]["params"][0]
    scalars, moments = split_entry(parts[0][BASE]["state"][first])
    flat = {"param": torch.cat(masters)}
    for key in moments:  # the moments cover the padded partition: keep the elements the master weights have
        flat[key] = torch.cat([sd[BASE]["state"][first][key].reshape(-1)[:m.numel()] for sd, m in zip(parts, masters)])
    return per_parameter(flat, scalars, tensors, order, files)


def hyperparameters(file: str, count: int) -> dict[str, Any]:
    """The one parameter group's settings (learning rate, betas, ...) without its ``params``."""
    return {k: v for k, v in read(file, count)[BASE]["param_groups"][0].items() if k != "params"}


def partition_state(template: dict[str, Any], names: list[str], weights: list[torch.Tensor],
                    states: list[dict[str, Any]], count: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s ZeRO-1 state dict of ``count`` for parameters ``names`` / ``weights`` (in order)
    and their Adam ``states``; ``template`` (an old file's) gives the loss scaler and the group's settings."""
    from deepspeed.utils.tensor_fragment import fragment_address

    total = sum(w.numel() for w in weights)
    padded = -(-total // (ALIGNMENT * count)) * ALIGNMENT * count
    size = padded // count
    lo, hi = rank * size, (rank + 1) * size

    def part(tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(padded, dtype=torch.float32)
        flat[:total] = torch.cat([t.reshape(-1) for t in tensors])
        return flat[lo:hi].clone()

    entry, moments = split_entry(states[0])
    entry.update({k: part([s[k] for s in states]) for k in moments})
    mappings, start = {}, 0
    for name, weight in zip(names, weights):
        first, last = max(start, lo), min(start + weight.numel(), hi)
        if first < last:
            mappings[name] = fragment_address(numel=last - first, start=first - lo)
        start += weight.numel()
    padding = padded - total if rank == count - 1 else 0
    group = {**template[BASE]["param_groups"][0], "params": [0]}
    return {**{k: v for k, v in template.items() if k not in (BASE, MASTER, MAPPINGS)},
            BASE: {"state": {0: entry}, "param_groups": [group]},
            MASTER: [part(weights)[: size - padding]], "group_paddings": [padding],
            "param_alignment_paddings": [[0] * len(names)], "partition_count": [count], MAPPINGS: [mappings]}
