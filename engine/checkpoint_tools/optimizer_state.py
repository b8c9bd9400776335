"""Optimizer state of a partial checkpoint -> one state dict keyed by the model's parameter names.

An unsharded smp2ds optimizer file (``optimizer_states_<pp>_<tp>.pt``: rdp rank 0's, ZeRO stage 0,
fp32) holds PyTorch's ``optimizer.state_dict()`` of one stage and tensor-parallel rank: state by
parameter *position*. Positions follow the stage's parameters in module order, which is the order
of the tensors in the same stage's model file with a tied head (the input embedding stored again
as ``lm_head.weight``) counted once. That mapping is checked, never assumed: the counts must
match and every moment must have its parameter piece's shape, else the file is refused by name.
Moments are then joined over tensor-parallel ranks exactly as their parameters (:mod:`.consolidate`).

Optimizer state sharded over data-parallel ranks (``optimizer_states_<pp>_<tp>_<rdp>.pt``:
DeepSpeed's flat partitions) is cut back into the same per-parameter state: sharded data
parallelism (ZeRO-3) by :mod:`.zero_partitions`, ``shard_optimizer_state`` (ZeRO-1) by
:mod:`.zero1_partitions`. 16-bit optimizer wrappers are refused with the reason.

Streaming (:class:`StateSource`): the exports read the unsharded files memory-mapped and join one parameter's
moment at a time, letting the mappings go every ``release_bytes`` read as the model files' reader does, so an
export holds one tensor's state, not the model's. Only the checks and the scalars (Adam's step) are read up front.
Sharded partitions are cut into per-parameter state whole (:func:`consolidate_optimizer`), a stage's files at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from smp2ds.engine.checkpoint_tools import zero1_partitions, zero_partitions
from smp2ds.engine.checkpoint_tools.checkpoint_folder import CheckpointLayout
from smp2ds.engine.checkpoint_tools.consolidate import (
    DEFAULT_RELEASE_BYTES,
    Entry,
    MappedFiles,
    ShardReader,
    join_pieces,
)
from smp2ds.engine.checkpoint_tools.reading import load_weights
from smp2ds.engine.checkpoint_tools.shard_rules import Split
from smp2ds.engine.exceptions import SMPCheckpointError, SMPUnsupportedError


def optimizer_path(out: str) -> str:
    """Where ``consolidate --with-optimizer`` writes the optimizer state, beside the model file ``out``."""
    stem = out[: -len(".safetensors")] if out.endswith(".safetensors") else out
    return f"{stem}.optimizer.pt"


_TIED_HEADS = ("lm_head.weight", "predictions.decoder.weight")
"""Output heads Hugging Face ties to the input embedding: one parameter, two state-dict names."""


def parameter_names(model_file: str, reader: ShardReader) -> dict[str, list[str]]:
    """The stage's parameters in order, each with all its names.

    A tied head is one parameter, but a stage's file stores it under both names as separate
    copies; it is recognised as a head name whose tensor equals an earlier one bit for bit (the
    caller's count check catches anything else).
    """
    names: dict[str, list[str]] = {}
    tensors = reader.tensors(model_file)
    for key, tensor in tensors.items():
        twin = None
        if key.endswith(_TIED_HEADS):
            twin = next((k for k in names if tensors[k].shape == tensor.shape and tensors[k].dtype == tensor.dtype
                         and torch.equal(tensors[k], tensor)), None)
        if twin is None:
            names[key] = [key]
        else:
            names[twin].append(key)
    return names


def torch_state(file: str) -> dict[str, Any]:
    return position_names(file)[0]


def position_names(file: str, mmap: bool = False) -> tuple[dict[str, Any], list[list[str]] | None]:
    """(PyTorch's optimizer state dict in one unsharded file, the parameter names smp2ds recorded per group);
    ``mmap``: its tensors mapped from the file, read when used."""
    obj = load_weights(file, mmap=mmap, deepspeed_state=True)
    if not isinstance(obj, dict):
        raise SMPCheckpointError(f"{file}: expected an optimizer state dict, found a {type(obj).__name__}")
    meta = obj.get("smp2ds") if isinstance(obj.get("smp2ds"), dict) else {}
    if int(meta.get("zero_stage", 0)) > 0 or meta.get("precision", "fp32") != "fp32":
        raise SMPUnsupportedError(
            f"{file}: optimizer state of ZeRO stage {meta.get('zero_stage')} with precision {meta.get('precision')!r} "
            "cannot be consolidated; allowed: fp32 optimizer state of ZeRO stage 0 (no shard_optimizer_state, no "
            "sharded data parallelism, no fp16/bf16)")
    sd = obj.get("ds_optimizer", obj)
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise SMPCheckpointError(f"{file}: not an optimizer state dict (no state / param_groups)")
    names = meta.get("param_names")
    return sd, names if isinstance(names, list) else None


def _named_stage(layout: CheckpointLayout, stage: int, rank: int, reader: ShardReader,
                 open_state: Callable[[str], tuple[dict[str, Any], list[list[str]] | None]] = position_names,
                 ) -> tuple[dict, list, dict[str, list[str]], dict[str, int]]:
    """({name: state}, param_groups with names, {name: its aliases}, {name: its position}) of one optimizer file
    (read by ``open_state``)."""
    file = layout.optimizer_files[(stage, rank, None)]
    model_file = layout.model_files[(stage, rank)]
    sd, recorded = open_state(file)
    names = parameter_names(model_file, reader)
    positions = [i for group in sd["param_groups"] for i in group["params"]]
    group_of = {int(i): g for g, group in enumerate(sd["param_groups"]) for i in group["params"]}
    if recorded is not None:  # smp2ds named each position's parameter: the groups' order is the script's
        order = [n for group in recorded for n in group]
        unknown = [n for n in order if n not in names]
        if len(order) != len(positions) or unknown:
            raise SMPCheckpointError(f"{file}: names {len(order)} parameters for {len(positions)} positions"
                                     + (f", {unknown[:3]} not in {os.path.basename(model_file)}" if unknown else "")
                                     + ": the files are of different saves")
    else:
        if len(positions) != len(names):
            raise SMPCheckpointError(f"{file}: holds {len(positions)} parameters but {os.path.basename(model_file)} "
                                     f"{len(names)} tensors; cannot tell which state belongs to which parameter (a "
                                     "model with buffers saved beside its parameters, or files of different saves)")
        order = list(names)  # PyTorch numbers them in the groups' order: the model's order for one group
    by_position = dict(zip(positions, order))
    tensors = reader.tensors(model_file)
    state: dict[str, dict[str, Any]] = {}
    for position, values in sd["state"].items():
        name = by_position.get(int(position))
        if name is None:
            raise SMPCheckpointError(f"{file}: state for parameter position {position}, which no group lists")
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) != tuple(tensors[name].shape):
                group = group_of.get(int(position), 0)
                why = ("the file does not record which parameter each position is (it predates smp2ds's "
                       f"param_names) and the {len(sd['param_groups'])} parameter groups do not follow the model's "
                       "order" if recorded is None and len(sd["param_groups"]) > 1
                       else "the state does not belong to this model file")
                raise SMPCheckpointError(f"{file}: {key} at position {position} of parameter group {group} (taken as "
                                         f"{name}) has shape {list(value.shape)} but {name} is "
                                         f"{list(tensors[name].shape)}: {why}")
        state[name] = values
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [by_position[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return state, groups, names, {name: int(position) for position, name in by_position.items()}


def partitioning(layout: CheckpointLayout) -> tuple[ModuleType, int]:
    """(the module that reads and writes the checkpoint's sharded optimizer files, how many ranks
    one set of partitions spans): ZeRO-3 over the shard group with sharded data parallelism, else
    ZeRO-1 over the rdp group."""
    return (zero_partitions, layout.sdp) if layout.sdp > 1 else (zero1_partitions, layout.rdp or 1)


def shard_files(layout: CheckpointLayout, stage: int, rank: int) -> list[str]:
    """The optimizer files of one set of partitions (rdp ranks ``0 ..``), by partition index."""
    return [layout.optimizer_files[(stage, rank, r)] for r in range(partitioning(layout)[1])]


def _sharded_stage(layout: CheckpointLayout, stage: int, rank: int,
                   reader: ShardReader) -> tuple[dict, list, dict[str, list[str]]]:
    """:func:`_named_stage` for DeepSpeed's flat partitions (ZeRO-3 or ZeRO-1, :func:`partitioning`)."""
    kind, count = partitioning(layout)
    files = shard_files(layout, stage, rank)
    names = parameter_names(layout.model_files[(stage, rank)], reader)
    tensors = reader.tensors(layout.model_files[(stage, rank)])
    if layout.param_groups is None or kind is not zero_partitions:
        state = kind.unflatten(files, tensors, list(names))
        groups = [{**kind.hyperparameters(files[0], count), "params": list(names)}]
        return state, groups, names
    # SMP's param_shapes: the flat partitions hold the groups' parameters one group after another
    for index, group in enumerate(layout.param_groups):
        for name in group:
            if name not in tensors:
                raise SMPCheckpointError(
                    f"{layout.extras.get('user_content')}: param_shapes names {name!r} in optimizer parameter group "
                    f"{index}, but {os.path.basename(layout.model_files[(stage, rank)])} holds no such tensor: the "
                    "user content belongs to another model")
    order = [name for group in layout.param_groups for name in group]
    state = kind.unflatten(files, tensors, order, grouped=True)
    settings = zero_partitions.group_settings(files[0], count)
    if len(settings) != len(layout.param_groups):
        raise SMPCheckpointError(f"{files[0]}: {len(settings)} optimizer parameter groups, but param_shapes in the "
                                 f"user content lists {len(layout.param_groups)}: they are of different saves")
    groups = [{**hyper, "params": list(group)} for hyper, group in zip(settings, layout.param_groups)]
    return state, groups, names


def consolidate_optimizer(layout: CheckpointLayout, entries: list[Entry], reader: ShardReader) -> dict[str, Any]:
    """``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}`` for the whole model."""
    return state_source(layout, entries, reader).materialize()


def _consolidate_sharded(layout: CheckpointLayout, entries: list[Entry], reader: ShardReader) -> dict[str, Any]:
    """:func:`consolidate_optimizer` of DeepSpeed's flat partitions, cut and joined whole."""
    by_key = {e.key: e for e in entries}
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    taken: set[str] = set()
    for stage in range(layout.pp):
        per_rank = [_sharded_stage(layout, stage, rank, reader) for rank in range(layout.tp)]
        aliases = per_rank[0][2]
        for name, values in per_rank[0][0].items():
            if any(a in state or a in taken for a in aliases[name]) or name not in by_key:
                continue  # a tied parameter on a later stage: the first stage's state (the same values)
            taken.update(aliases[name])
            state[name] = {key: join_pieces([per_rank[r][0][name][key] for r in range(layout.tp)],
                                            by_key[name].split) if _is_moment(value)
                           else value.clone() if isinstance(value, torch.Tensor) else value
                           for key, value in values.items()}
        _collect_groups(groups, per_rank[0][1], state)
    return {"state": state, "param_groups": groups}


def _is_moment(value: Any) -> bool:
    """A per-element state tensor (Adam's moments), as opposed to a scalar such as ``step``."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


class _MappedOptimizerFiles(MappedFiles):
    """Unsharded optimizer files, memory-mapped on first use and let go after ``release_bytes`` read."""

    def _load(self, file: str) -> tuple[dict[str, Any], list[list[str]] | None]:
        return position_names(file, mmap=True)

    def state_dict(self, file: str) -> tuple[dict[str, Any], list[list[str]] | None]:
        return self._opened(file)

    def moment(self, file: str, position: int, key: str) -> torch.Tensor:
        return self._counted(self.state_dict(file)[0]["state"][position][key])


@dataclass
class StateSource:
    """A checkpoint's optimizer state by parameter name, each moment joined when asked for.

    ``scalars`` and ``moments`` are known up front (read when the source is built, every file checked);
    :meth:`tensor` joins one moment of one parameter over the tensor-parallel ranks. Call :meth:`release` when
    no tensor it gave is referenced any more, so the mapped files can go.
    """

    param_groups: list[dict[str, Any]]
    """The groups' hyperparameters, ``params`` their parameters' names (as :func:`consolidate_optimizer`)."""
    scalars: dict[str, dict[str, Any]]
    """name -> its state's scalars (``step``)."""
    moments: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]
    """name -> {moment key: (full shape, dtype)}."""
    _join: Callable[[str, str], torch.Tensor]
    _release: Callable[[bool], None] = field(default=lambda force: None)

    def tensor(self, name: str, key: str) -> torch.Tensor:
        """The full ``key`` moment of parameter ``name`` (a mapping of the file, or a joined copy)."""
        return self._join(name, key)

    def release(self, force: bool = False) -> None:
        """Let the mapped files go once enough was read, or now with ``force`` (call with no tensor from
        :meth:`tensor` referenced)."""
        self._release(force)

    def materialize(self) -> dict[str, Any]:
        """``{"state": {name: {...}}, "param_groups": [...]}``, every moment read."""
        state = {name: {**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()},
                        **{key: self.tensor(name, key) for key in self.moments[name]}}
                 for name, scalars in self.scalars.items()}
        return {"state": state, "param_groups": self.param_groups}


def whole_source(optim: dict[str, Any]) -> StateSource:
    """A :class:`StateSource` over state already in memory."""
    state = optim["state"]
    return StateSource(
        param_groups=optim["param_groups"],
        scalars={n: {k: v for k, v in values.items() if not _is_moment(v)} for n, values in state.items()},
        moments={n: {k: (tuple(v.shape), v.dtype) for k, v in values.items() if _is_moment(v)}
                 for n, values in state.items()},
        _join=lambda name, key: state[name][key])


def state_source(layout: CheckpointLayout, entries: list[Entry], reader: ShardReader,
                 release_bytes: int = DEFAULT_RELEASE_BYTES) -> StateSource:
    """The optimizer state of ``layout`` as a :class:`StateSource`: streamed from unsharded files, built whole
    from sharded partitions."""
    if not layout.optimizer_files:
        raise SMPCheckpointError(f"{layout.directory}: --with-optimizer, but the checkpoint holds no optimizer state")
    if layout.optimizer_sharded:
        return whole_source(_consolidate_sharded(layout, entries, reader))
    files = _MappedOptimizerFiles(release_bytes)
    by_key = {e.key: e for e in entries}
    where: dict[str, tuple[list[tuple[str, int]], Split | None]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    moments: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
    groups: list[dict[str, Any]] = []
    taken: set[str] = set()
    for stage in range(layout.pp):
        per_rank = [_named_stage(layout, stage, rank, reader, files.state_dict) for rank in range(layout.tp)]
        aliases = per_rank[0][2]
        for name, values in per_rank[0][0].items():
            if any(a in scalars or a in taken for a in aliases[name]) or name not in by_key:
                continue  # a tied parameter on a later stage: the first stage's state (the same values)
            taken.update(aliases[name])
            entry = by_key[name]
            where[name] = ([(layout.optimizer_files[(stage, r, None)], per_rank[r][3][name]) for r in
                            range(layout.tp)], entry.split)
            scalars[name] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in values.items()
                             if not _is_moment(v)}
            moments[name] = {k: (entry.shape, v.dtype) for k, v in values.items() if _is_moment(v)}
        _collect_groups(groups, per_rank[0][1], scalars)
        del per_rank
        files.maybe_release(force=True)
        reader.maybe_release(force=True)

    def join(name: str, key: str) -> torch.Tensor:
        pieces, split = where[name]
        return join_pieces([files.moment(file, position, key) for file, position in pieces], split)

    return StateSource(groups, scalars, moments, join, files.maybe_release)


def _collect_groups(groups: list[dict[str, Any]], stage_groups: list[dict[str, Any]], owned: Any) -> None:
    """Add one stage's parameter groups (by index) to the model's, keeping parameters that have state here."""
    for index, group in enumerate(stage_groups):
        if index == len(groups):
            groups.append({**group, "params": []})
        groups[index]["params"] += [n for n in group["params"] if n in owned and n not in groups[index]["params"]]
