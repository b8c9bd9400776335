"""ZeRO-3 optimizer partitions (sharded data parallelism) <-> Adam state per parameter.

With ``sharded_data_parallel_degree`` S every rank's ``optimizer_states_<pp>_<tp>_<rdp>.pt``
holds DeepSpeed ZeRO-3's ``state_dict()`` of its shard: ``fp32_flat_groups`` (the fp32 master
weights) and ``optimizer_state_dict`` (Adam's moments over those flat tensors). ZeRO-3 cuts every
parameter on its own: the (tensor-parallel local) parameter, flattened and zero-padded to a
multiple of S, gives shard rank ``s`` its elements ``[s * p, (s + 1) * p)`` with
``p = ceil(numel / S)``; a shard's flat tensor is those slices of the stage's parameters in order.
Shard rank ``s`` is reduced-data-parallel rank ``s`` (rdp ranks ``s``, ``s + S``, ... are its
replicas and hold the same state).

The parameter order is the model file's (a tied head counted once). It is checked, never
assumed: the flat lengths must fit the parameters' sizes and the master weights cut back out of
the flat tensors must equal the model file's weights bit for bit, else the file is refused by
name. Refused too: a file of another ZeRO stage than the configuration implies, 16-bit training,
and more than one parameter group (which parameters each group's flat tensor holds is not saved).
:func:`read_zero`, :func:`per_parameter` and :func:`split_entry` are shared with
:mod:`.zero1_partitions` (``shard_optimizer_state``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from smp2ds.engine.checkpoint_tools.reading import load_weights
from smp2ds.engine.core import sdp_checkpoint
from smp2ds.engine.exceptions import SMPCheckpointError, SMPUnsupportedError

MASTER = "fp32_flat_groups"
INNER = "optimizer_state_dict"


def shard_size(numel: int, count: int) -> int:
    """Elements of one parameter of ``numel`` elements on each of ``count`` shard ranks (ZeRO-3's padding)."""
    return -(-numel // count)


def read_zero(file: str, stage: int) -> dict[str, Any]:
    """DeepSpeed's state dict in one rank's optimizer file, refused by name unless fp32 ZeRO ``stage``.

    Shared with :mod:`.zero1_partitions` (stage 1): both refuse 16-bit state and the other stage.
    """
    obj = load_weights(file, mmap=False, deepspeed_state=True)
    if isinstance(obj, dict) and MASTER in obj:  # SMP's sharded-data-parallel layout: DeepSpeed's dict at the top
        obj = sdp_checkpoint.engine_optimizer_state(obj)
    meta = obj.get("smp2ds") if isinstance(obj, dict) and isinstance(obj.get("smp2ds"), dict) else {}
    # A file SMP wrote does not say its precision: its fp32 masters are checked against the weights instead.
    saved, precision = int(meta.get("zero_stage", 0)), meta.get("precision", "fp32")
    if saved != stage or precision != "fp32":
        what = {1: "shard_optimizer_state", 2: "ZeRO-2", 3: "sharded data parallelism"}.get(saved, "unsharded")
        raise SMPUnsupportedError(
            f"{file}: optimizer state of ZeRO stage {saved} ({what}) with precision {precision!r} where the "
            f"checkpoint's configuration implies stage {stage}; allowed: fp32 optimizer state, unsharded, of "
            "shard_optimizer_state (ZeRO stage 1) or of sharded data parallelism (ZeRO stage 3)")
    sd = obj.get("ds_optimizer")
    if not isinstance(sd, dict):
        raise SMPCheckpointError(f"{file}: no DeepSpeed optimizer state (ds_optimizer) in this file")
    return sd


def per_parameter(flat: dict[str, torch.Tensor], scalars: dict[str, Any], tensors: dict[str, torch.Tensor],
                  order: list[str], files: list[str]) -> dict[str, dict[str, Any]]:
    """Cut ``flat`` (``{"param": master weights, moment: values}``, the parameters of ``order``
    one after another, unpadded) into ``{name: Adam state}``; every master weight must equal the
    model file's, else ``files`` are refused (wrong order or another save)."""
    total = sum(tensors[n].numel() for n in order)
    if any(v.numel() != total for v in flat.values()):
        raise SMPCheckpointError(
            f"{', '.join(files)}: flat partitions of {flat['param'].numel()} elements in all, but the model file's "
            f"{len(order)} parameters hold {total}: the state does not belong to this model file")
    state: dict[str, dict[str, Any]] = {}
    start = 0
    for name in order:
        shape, numel = tensors[name].shape, tensors[name].numel()
        values = {k: v[start:start + numel].reshape(shape).clone() for k, v in flat.items()}
        if not torch.equal(values.pop("param"), tensors[name].to(torch.float32)):
            raise SMPCheckpointError(
                f"{os.path.dirname(files[0])}: the master weights of {name} cut out of "
                f"{', '.join(os.path.basename(f) for f in files)} differ from the model file's: the parameter order "
                "is not the model file's, or the files are of different saves")
        state[name] = {**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}, **values}
        start += numel
    return state


def split_entry(entry: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the 0-dimensional values of an optimizer state entry, e.g. ``step``; the flat moments' keys)."""
    moments = [k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim()]
    return {k: v for k, v in entry.items() if k not in moments}, moments


def read(file: str, count: int, grouped: bool = False) -> dict[str, Any]:
    """The ZeRO-3 state dict of one rank's file, refused by name unless fp32 ZeRO-3 over ``count`` ranks.

    ``grouped``: the caller knows which parameters each optimizer parameter group holds (SMP's ``param_shapes``);
    without it more than one group is refused.
    """
    sd = read_zero(file, 3)
    if MASTER not in sd or INNER not in sd:
        raise SMPCheckpointError(f"{file}: not a ZeRO-3 optimizer state dict (no {MASTER} / {INNER})")
    if sdp_checkpoint.partition_count(sd) != count:
        raise SMPCheckpointError(f"{file}: partitioned over {sd.get('partition_count')} ranks, but the checkpoint's "
                                 f"sharded_data_parallel_degree is {count}")
    if len(sd[INNER]["param_groups"]) != 1 and not grouped:
        raise SMPUnsupportedError(
            f"{file}: {len(sd[INNER]['param_groups'])} optimizer parameter groups under sharded data parallelism, "
            "and the user content has no param_shapes saying which parameters each group's flat partition holds; "
            "allowed: one parameter group, or user_content['param_shapes'] as SMP's GPT-2 example saves it")
    return sd


def _flat(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{"param": master weights, moment: values}``, each one flat tensor over the shard's groups and sub-groups
    (in DeepSpeed's order: the groups one after another)."""
    inner = sd[INNER]
    positions = [p for group in inner["param_groups"] for p in group["params"]]
    out = {"param": torch.cat([t.reshape(-1) for t in sd[MASTER]])}
    for key in split_entry(inner["state"][positions[0]])[1]:
        out[key] = torch.cat([inner["state"][p][key].reshape(-1) for p in positions])
    return out


def unflatten(files: list[str], tensors: dict[str, torch.Tensor], names: list[str],
              grouped: bool = False) -> dict[str, dict[str, Any]]:
    """``{name: Adam state}`` of one stage and tensor-parallel rank from its shard ranks' ``files``.

    ``tensors``: the same rank's model-file weights; ``names``: its parameters in the flat partitions' order
    (``grouped``: the groups' names one group after another, as :func:`read` takes it).
    """
    count = len(files)
    shards = [read(f, count, grouped) for f in files]
    flats = [_flat(sd) for sd in shards]
    sizes = [shard_size(tensors[n].numel(), count) for n in names]
    for file, flat in zip(files, flats):
        if any(v.numel() != sum(sizes) for v in flat.values()):
            raise SMPCheckpointError(
                f"{file}: flat partition of {flat['param'].numel()} elements, but the model file's {len(names)} "
                f"parameters give {sum(sizes)} per shard rank: the state does not belong to this model file")
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    joined = {k: torch.cat([torch.cat([f[k][o:o + size] for f in flats])[:tensors[n].numel()]
                            for n, o, size in zip(names, offsets, sizes)]) for k in flats[0]}
    inner = shards[0][INNER]
    scalars = split_entry(inner["state"][inner["param_groups"][0]["params"][0]])[0]
    return per_parameter(joined, scalars, tensors, names, files)


def hyperparameters(file: str, count: int) -> dict[str, Any]:
    """The one parameter group's settings (learning rate, betas, ...) without its ``params``."""
    return group_settings(file, count)[0]


def group_settings(file: str, count: int) -> list[dict[str, Any]]:
    """Every parameter group's settings (learning rate, weight decay, ...) without its ``params``, in order."""
    return [{k: v for k, v in group.items() if k != "params"}
            for group in read(file, count, grouped=True)[INNER]["param_groups"]]


def partition_state(template: dict[str, Any], names: list[str], weights: list[torch.Tensor],
                    states: list[dict[str, Any]], count: int, rank: int) -> dict[str, Any]:
    """Shard rank ``rank``'s ZeRO-3 state dict of ``count`` for parameters ``weights`` (in order) and
    their Adam ``states``; ``template`` (an old file's) gives the loss scaler and the group's settings."""
    def cut(tensor: torch.Tensor) -> torch.Tensor:
        size = shard_size(tensor.numel(), count)
        flat = torch.zeros(size * count, dtype=torch.float32)
        flat[: tensor.numel()] = tensor.reshape(-1)
        return flat[rank * size:(rank + 1) * size]

    entry, moments = split_entry(states[0])
    entry.update({k: torch.cat([cut(s[k]) for s in states]) for k in moments})
    group = {**template[INNER]["param_groups"][0], "params": [0]}
    return {**{k: v for k, v in template.items() if k not in (MASTER, INNER)}, "partition_count": count,
            INNER: {"state": {0: entry}, "param_groups": [group]}, MASTER: [torch.cat([cut(w) for w in weights])]}
