"""A partial checkpoint re-cut for another tensor-parallel / data-parallel layout, optimizer included.

Weights are joined (:mod:`.consolidate`) and cut again for the new ``tensor_parallel_degree`` by
the same rule that joined them; Adam's moments are cut exactly as their parameters
(:mod:`.optimizer_state`). The result is an smp2ds partial checkpoint (``newest``,
``<tag>_partial/`` with ``model_<pp>_<tp>.pt``, ``optimizer_states_<pp>_<tp>.pt``,
``smp_config.pt`` with the new degrees, ``user_content.pt`` copied byte for byte, and the
manifest, published atomically), which ``smp.resume_from_checkpoint`` loads at the new layout.

Refused before anything is written, with the reason: another pipeline degree (which layers form a
stage is decided by the model's partitioner at run time; the checkpoint does not say how to
re-split them), 16-bit optimizer state, a degree that does not divide a split tensor, and an output
that already holds this tag.

Sharded optimizer state is written as it was saved: ZeRO-1 (``shard_optimizer_state``) partitions
re-cut for the new rdp (:mod:`.zero1_partitions`); a checkpoint of a sharded data-parallel run for
another ``sharded_data_parallel_degree`` (``--sdp``, default the saved one), each new rdp rank
holding the ZeRO-3 partition of its shard rank (:mod:`.zero_partitions`). Going from or to no
sharded data parallelism is refused (the ZeRO-3 files carry DeepSpeed's loss-scaler
state, which an unsharded checkpoint does not have). Memory: the full model and its optimizer
state are held at once.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from smp2ds.engine.checkpoint_tools import consolidate, optimizer_state
from smp2ds.engine.checkpoint_tools.checkpoint_folder import CheckpointLayout
from smp2ds.engine.checkpoint_tools.shard_rules import Split
from smp2ds.engine.core import checkpoint_commit as commit
from smp2ds.engine.core import checkpoint_format as fmt
from smp2ds.engine.exceptions import SMPInvalidArgumentError, SMPUnsupportedError
from smp2ds.engine.nn.parallel.shards import ShardSpec


def cut(full: torch.Tensor, split: Split | None, size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` out of ``size``, cut as the engine cuts it (whole when not split)."""
    if split is None or size == 1:
        return full.clone()
    return ShardSpec(split.dim, size, split.blocks).local(full, rank)


def target_rdp(tp: int, pp: int, rdp: int | None, world: int | None) -> int:
    """The data-parallel degree from ``--rdp`` or ``--world`` (exactly one, or neither: 1)."""
    if rdp is not None and world is not None:
        raise SMPInvalidArgumentError(f"give --rdp or --world, not both (got --rdp {rdp} --world {world})")
    if world is None:
        return rdp or 1
    if world % (tp * pp):
        raise SMPInvalidArgumentError(f"--world {world} is not a multiple of --tp {tp} x --pp {pp}; allowed: "
                                      f"multiples of {tp * pp}")
    return world // (tp * pp)


def target_sdp(layout: CheckpointLayout, sdp: int | None, rdp: int) -> int:
    """The new ``sharded_data_parallel_degree`` (default: the saved one), refused unless it can be written."""
    new = layout.sdp if sdp is None else sdp
    if (new > 1) != (layout.sdp > 1):
        raise SMPUnsupportedError(
            f"--sdp {new}: the checkpoint has sharded_data_parallel_degree {layout.sdp}; reshard keeps sharded data "
            "parallelism on or off (ZeRO-3 files carry DeepSpeed state an unsharded checkpoint lacks); allowed: "
            + ("--sdp 1" if layout.sdp == 1 else "--sdp values above 1 that divide the new rdp"))
    if rdp % new:
        choices = [s for s in range(2, rdp + 1) if rdp % s == 0]
        allowed = (f"--sdp one of {choices}" if choices else
                   f"no --sdp at rdp {rdp}: sharded data parallelism needs a reduced data-parallel degree of 2 or "
                   f"more; give --rdp R or --world W so that {new} divides R")
        raise SMPInvalidArgumentError(f"--sdp {new} does not divide the new reduced data-parallel degree {rdp}; "
                                      f"allowed: {allowed}")
    return new


def _check(layout: CheckpointLayout, entries: list[consolidate.Entry], out: str, tp: int, pp: int) -> None:
    if pp != layout.pp:
        raise SMPUnsupportedError(
            f"--pp {pp}: the checkpoint has pipeline_parallel_degree {layout.pp}; which layers form a stage is "
            "decided by the model's partitioner at run time, so stages are not re-cut offline; allowed: "
            f"--pp {layout.pp} (tensor- and data-parallel degrees may change)")
    for entry in entries:
        if entry.split is not None and entry.shape[entry.split.dim] % (entry.split.blocks * tp):
            raise SMPInvalidArgumentError(
                f"--tp {tp}: {entry.key} has {entry.shape[entry.split.dim]} along dimension {entry.split.dim}, "
                f"which does not split into {entry.split.blocks} block(s) x {tp} ranks; choose a degree that "
                "divides it")
    target = os.path.join(out, fmt.partial_entry(layout.tag or "resharded"))
    if os.path.exists(target):
        raise SMPInvalidArgumentError(f"{target} exists already; choose "
                                      "another --out (reshard never overwrites a checkpoint)")


def reshard(layout: CheckpointLayout, out: str, tp: int, pp: int, rdp: int = 1, sdp: int | None = None) -> list[str]:
    """Write ``out/<tag>_partial`` at tp ``tp`` x pp ``pp`` x rdp ``rdp`` (sharded data parallelism
    ``sdp``, default the saved degree); returns the files written."""
    reader = consolidate.ShardReader()
    entries = consolidate.checked_plan(layout, reader)
    tag = layout.tag or "resharded"
    layout.tag = tag
    sdp = target_sdp(layout, sdp, rdp)
    _check(layout, entries, out, tp, pp)
    optim = optimizer_state.consolidate_optimizer(layout, entries, reader) if layout.optimizer_files else None
    if optim is not None and layout.optimizer_sharded and len(optim["param_groups"]) > 1:
        raise SMPUnsupportedError(
            f"{layout.directory}: {len(optim['param_groups'])} optimizer parameter groups; reshard writes sharded "
            "optimizer state of one group only (DeepSpeed's flat partitions do not record group boundaries); "
            "allowed: checkpoints of one parameter group, or `consolidate --with-optimizer` / `export` to take "
            "the state out by parameter name")
    full = dict(consolidate.iter_tensors(entries, reader))
    split = {e.key: e.split for e in entries}
    entry = fmt.partial_entry(tag)
    os.makedirs(out, exist_ok=True)
    commit.tidy(out)
    stage_dir = commit.stage_dir(out, entry, os.urandom(8).hex())
    os.makedirs(stage_dir)
    records: list[commit.FileRecord] = []
    info = {"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "partition_info": None}
    for stage in range(pp):
        keys = list(reader.tensors(layout.model_files[(stage, 0)]))
        for rank in range(tp):
            sd: dict[str, Any] = {k: cut(full[k], split[k], tp, rank) for k in keys}
            sd.update({fmt.PARTIAL_MARK: True, fmt.LOAD_INFO: dict(info)})
            records.append(commit.write_file(sd, stage_dir, fmt.model_file(stage, rank), stage * tp + rank))
            if optim is not None and layout.optimizer_sharded:
                records += _write_shards(layout, stage, optim, full, split, (tp, rank), (rdp, sdp), reader, stage_dir)
            elif optim is not None:
                state = _stage_optimizer(layout, stage, optim, split, tp, rank, rdp, reader)
                records.append(commit.write_file(state, stage_dir, fmt.optimizer_file(stage, rank),
                                                 stage * tp + rank))
    config = {**layout.config, "tensor_parallel_degree": tp, "pipeline_parallel_degree": pp,
              "sharded_data_parallel_degree": sdp, "smp_version": fmt.SMP2DS_CHECKPOINT_VERSION}
    records.append(commit.write_file(config, stage_dir, fmt.SMP_CONFIG, 0))
    if "user_content" in layout.extras:  # copied as bytes: user content may be any pickle, never loaded here
        file = os.path.join(stage_dir, fmt.USER_CONTENT)
        shutil.copyfile(layout.extras["user_content"], file)
        records.append(commit.FileRecord(fmt.USER_CONTENT, os.path.getsize(file), commit.file_digest(file), 0))
    saved = {"world_size": tp * pp * rdp, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "rdp": rdp,
             "optimizer_saved": optim is not None, "optimizer_sharded": optim is not None and layout.optimizer_sharded}
    commit.seal(out, entry, stage_dir, records, saved, tag, fmt.SMP2DS_CHECKPOINT_VERSION, None)
    return sorted(r.name for r in records)


def _stage_optimizer(layout: CheckpointLayout, stage: int, optim: dict[str, Any], split: dict[str, Split | None],
                     tp: int, rank: int, rdp: int, reader: consolidate.ShardReader) -> dict[str, Any]:
    """One new rank's optimizer file: the old stage's parameter positions, each moment cut as its parameter."""
    old, recorded = optimizer_state.position_names(layout.optimizer_files[(stage, 0, None)])
    names = optimizer_state.parameter_names(layout.model_files[(stage, 0)], reader)
    positions = [i for group in old["param_groups"] for i in group["params"]]
    order = [n for group in recorded for n in group] if recorded is not None else list(names)
    state = {}
    for position, name in zip(positions, order):
        known = next((a for a in names[name] if a in optim["state"]), None)
        if known is None:
            continue  # no state yet (a parameter without gradient)
        state[position] = {k: cut(v, split[known], tp, rank) if isinstance(v, torch.Tensor) and v.dim() else v
                           for k, v in optim["state"][known].items()}
    meta: dict[str, Any] = {"zero_stage": 0, "precision": "fp32", "rdp_rank": 0, "rdp_size": rdp}
    if recorded is not None:
        meta["param_names"] = recorded
    return {"ds_optimizer": {"state": state, "param_groups": old["param_groups"]}, "smp2ds": meta,
            fmt.PARTIAL_MARK: True}


def _write_shards(layout: CheckpointLayout, stage: int, optim: dict[str, Any], full: dict[str, torch.Tensor],
                  split: dict[str, Split | None], tp: tuple[int, int], ranks: tuple[int, int],
                  reader: consolidate.ShardReader, stage_dir: str) -> list[commit.FileRecord]:
    """One new tp rank's sharded files, ``optimizer_states_<stage>_<tp>_<rdp>.pt`` for every rdp rank:
    ZeRO-3 with sharded data parallelism (rank ``r`` holds shard ``r % sdp``), else ZeRO-1 (rank ``r``
    holds partition ``r`` of rdp), as the checkpoint had; weights and moments cut as their
    parameters, then flattened."""
    (size, rank), (rdp, sdp) = tp, ranks
    kind, old_count = optimizer_state.partitioning(layout)
    count, zero_stage = (sdp, 3) if sdp > 1 else (rdp, 1)
    names = list(optimizer_state.parameter_names(layout.model_files[(stage, 0)], reader))
    missing = [n for n in names if n not in optim["state"]]
    if missing:
        raise SMPInvalidArgumentError(f"{layout.directory}: no optimizer state for {', '.join(missing)}; DeepSpeed "
                                      "keeps state for every parameter, so these files are not of one save")
    weights = [cut(full[n], split[n], size, rank) for n in names]
    states = [{k: cut(v, split[n], size, rank) if isinstance(v, torch.Tensor) and v.dim() else v
               for k, v in optim["state"][n].items()} for n in names]
    template = kind.read(optimizer_state.shard_files(layout, stage, 0)[0], old_count)
    shards = [kind.partition_state(template, names, weights, states, count, s) for s in range(count)]
    records = []
    for r in range(rdp):
        meta = {"zero_stage": zero_stage, "precision": "fp32", "rdp_rank": r, "rdp_size": rdp}
        body = {"ds_optimizer": shards[r % count], "smp2ds": meta, fmt.PARTIAL_MARK: True}
        records.append(commit.write_file(body, stage_dir, fmt.optimizer_file(stage, rank, r),
                                         (stage * size + rank) * rdp + r))
    return records
