"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` (SMP 1.10+ layout, named in :mod:`checkpoint_format`).

With ``partial=True`` each (pp, tp) rank of rdp rank 0 writes its ``model.local_state_dict()``, rdp rank 0 (every
rdp rank when the optimizer state is sharded) its optimizer part, rank 0 the user content, the configuration and,
last, the manifest: every file's size, SHA-256 and writer rank, and the layout. ``partial=False`` writes the full
model state dict from rank 0.

A partial checkpoint is staged in a hidden folder and renamed into place once sealed
(:mod:`checkpoint_commit`); resume checks it against its manifest (:mod:`checkpoint_verify`).

Under sharded data parallelism at tensor- and pipeline-parallel degree 1 the folder is SMP's own sharded-data-parallel
layout instead (``<tag>/model_0.pt``, ``optimizer_<s>.pt``: :mod:`sdp_checkpoint`), the one SMP's
``sharded_data_parallel_checkpoint.py`` helper reads; resume reads either layout, and checkpoints SMP wrote.

fp16 loss-scaler and master-weight state travel inside the optimizer file (DeepSpeed keeps
them in its optimizer state), so no separate ``fp16_states_*`` file is written.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from smp2ds.engine.api.pretrained_save import to_hf_names
from smp2ds.engine.core import checkpoint_commit as commit
from smp2ds.engine.core import checkpoint_format as names
from smp2ds.engine.core import checkpoint_verify, safe_load
from smp2ds.engine.core import object_collectives as collectives
from smp2ds.engine.core import sdp_checkpoint as sdp_files
from smp2ds.engine.core.ranks import CommGroup
from smp2ds.engine.core.save_load import atomic_torch_save, fsync_dir
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import IncompatibleCheckpointFoundError, SMPCheckpointError

_STRICT_KEYS = ("pipeline_parallel_degree", "tensor_parallel_degree", "shard_optimizer_state",
                "sharded_data_parallel_degree")


def _coords() -> Any:
    return state.groups.coords


def _optimizer_file(directory: str, sharded: bool) -> str:
    c = _coords()
    return os.path.join(directory, names.optimizer_file(c.pp_rank, c.tp_rank, c.rdp_rank if sharded else None))


def _model_file(directory: str) -> str:
    c = _coords()
    return os.path.join(directory, names.model_file(c.pp_rank, c.tp_rank))


def _load(path: str, user_content: bool = False, trust: bool | None = None) -> Any:
    """A checkpoint file read without running code from it (:mod:`safe_load`)."""
    return safe_load.load(path, user_content=user_content, trust=trust)


def _layout(optimizer_saved: bool, sharded: bool) -> dict[str, Any]:
    topo = state.groups.topology
    return {"world_size": topo.world_size, "pipeline_parallel_degree": topo.pp, "tensor_parallel_degree": topo.tp,
            "rdp": topo.rdp, "optimizer_saved": optimizer_saved, "optimizer_sharded": sharded}


def save_checkpoint(path: str, tag: str, partial: bool = True, model: Any = None, optimizer: Any = None,
                    user_content: Any = None, translate_if_full: bool = True,
                    num_kept_partial_checkpoints: int | None = None) -> None:
    """Write a partial (per-rank) or full checkpoint; collective over all ranks.

    A partial checkpoint is whole or absent after a crash at any point (see :mod:`checkpoint_commit`).
    """
    state.require()
    if not isinstance(tag, str):
        raise SMPCheckpointError(f"tag must be a str, got {type(tag).__name__}")
    rank = state.groups.rank
    if rank == 0:
        commit.tidy(path)  # before any rank writes: leftovers of a crashed save go first
    nonce = os.urandom(8).hex()
    agreed = collectives.allgather((tag, nonce), CommGroup.WORLD)
    tags = [t for t, _ in agreed]
    if len(set(tags)) != 1:
        raise SMPCheckpointError(f"save_checkpoint tag differs between ranks: {tags}")
    if partial:
        _save_partial(path, tag, agreed[0][1], model, optimizer, user_content, num_kept_partial_checkpoints)
    else:
        _save_full(path, tag, model, optimizer, user_content, translate_if_full)
    collectives.barrier()


def _sdp_layout() -> Any:
    """This rank's MiCS layout when partial checkpoints take SMP's sharded-data-parallel layout, else None."""
    groups, topo = state.mics_groups, state.groups.topology
    if groups is None or groups.shard_size <= 1 or topo.tp != 1 or topo.pp != 1:
        return None
    return groups.layout


def _save_partial(path: str, tag: str, nonce: str, model: Any, optimizer: Any, user_content: Any,
                  keep: int | None) -> None:
    if _sdp_layout() is not None:
        _save_sdp(path, tag, nonce, model, optimizer, user_content, keep)
        return
    rank, c = state.groups.rank, _coords()
    entry = names.partial_entry(tag)
    stage = commit.stage_dir(path, entry, nonce)
    os.makedirs(stage, exist_ok=True)
    records: list[commit.FileRecord] = []
    # Some backends gather parameters for local_state_dict (collective): then every rank calls it.
    if model is not None and (c.rdp_rank == 0 or model.backend.collective_state_dict):
        sd = model.local_state_dict()
        if c.rdp_rank == 0:
            records.append(commit.write_file(sd, stage, os.path.basename(_model_file(stage)), rank))
    sharded = bool(optimizer.backend.optimizer_state_is_sharded) if optimizer is not None else False
    if optimizer is not None and (sharded or c.rdp_rank == 0):
        name = os.path.basename(_optimizer_file(stage, sharded))
        records.append(commit.write_file(optimizer.local_state_dict(), stage, name, rank))
    if rank == 0:
        records += _rank0_files(stage, user_content)
    _seal(path, entry, stage, records, _layout(optimizer is not None, sharded), tag, keep)


def _rank0_files(stage: str, user_content: Any) -> list[commit.FileRecord]:
    """The user content and the configuration, written by rank 0 into the staged folder."""
    records = []
    if user_content is not None:
        records.append(commit.write_file(user_content, stage, names.USER_CONTENT, 0))
    config = {**state.cfg.get_config_dict(), "smp_version": names.SMP2DS_CHECKPOINT_VERSION}
    records.append(commit.write_file(config, stage, names.SMP_CONFIG, 0))
    return records


def _seal(path: str, entry: str, stage: str, records: list[commit.FileRecord], layout: dict[str, Any], tag: str,
          keep: int | None, single_newest: bool = False) -> None:
    """Every rank's files on disk: rank 0 seals and publishes the folder (:mod:`checkpoint_commit`)."""
    rank = state.groups.rank
    commit.fault_point("files_written", rank)
    fsync_dir(stage)
    everyone = collectives.allgather(records, CommGroup.WORLD)
    if rank == 0:
        commit.seal(path, entry, stage, [r for part in everyone for r in part], layout, tag,
                    names.SMP2DS_CHECKPOINT_VERSION, keep, single_newest=single_newest)


def _save_sdp(path: str, tag: str, nonce: str, model: Any, optimizer: Any, user_content: Any,
              keep: int | None) -> None:
    """SMP's sharded-data-parallel layout: ``<tag>/model_0.pt`` from rank 0, ``optimizer_<s>.pt`` from each shard
    rank ``s`` of the first shard group (the other groups hold the same state), ``newest`` naming ``<tag>``."""
    rank, layout = state.groups.rank, _sdp_layout()
    stage = commit.stage_dir(path, tag, nonce)
    os.makedirs(stage, exist_ok=True)
    records: list[commit.FileRecord] = []
    if model is not None:
        sd = model.local_state_dict()  # collective: gathers over the shard group
        if rank == 0:
            records.append(commit.write_file(sdp_files.model_body(sd), stage, names.SDP_MODEL, rank))
    if optimizer is not None and layout.shard_index == 0:
        local = optimizer.local_state_dict()
        body = sdp_files.optimizer_body(local["ds_optimizer"], local["smp2ds"])
        records.append(commit.write_file(body, stage, names.sdp_optimizer_file(layout.shard_rank), rank))
    if rank == 0:
        records += _rank0_files(stage, user_content)
    topo_layout = {**_layout(optimizer is not None, True), "sharded_data_parallel_degree": layout.shard_size,
                   "smp_sdp_layout": True}
    _seal(path, tag, stage, records, topo_layout, tag, keep, single_newest=True)


def _save_full(path: str, tag: str, model: Any, optimizer: Any, user_content: Any, translate_if_full: bool) -> None:
    rank = state.groups.rank
    if optimizer is not None:
        warnings.warn("save_checkpoint(partial=False) saves only the model; the optimizer is skipped (SMP "
                      "semantics); use partial=True to keep optimizer state", stacklevel=3)
    if model is not None:
        sd = model.state_dict()
        if translate_if_full and state.module_manager.translate_functions:
            sd = to_hf_names(sd)
        else:
            sd[names.PARTIAL_MARK] = False
        if rank == 0:
            atomic_torch_save(sd, os.path.join(path, tag))
    if rank == 0 and user_content is not None:
        atomic_torch_save(user_content, os.path.join(path, names.full_user_content(tag)))


def _check_config(directory: str, load_optimizer: bool, trust: bool | None) -> None:
    verify = os.environ.get("SMP_VERIFY_CHECKPOINT_CONFIG", "1").strip()
    if verify not in ("0", "1", ""):
        raise SMPCheckpointError(f"environment variable SMP_VERIFY_CHECKPOINT_CONFIG={verify!r} is not a switch; "
                                 "allowed: 0 (skip the configuration check) or 1")
    if verify == "0":
        return
    cfg_path = os.path.join(directory, names.SMP_CONFIG)
    if not os.path.exists(cfg_path):
        return
    saved, now = _load(cfg_path, trust=trust), state.cfg.get_config_dict()
    diffs = {k: (saved.get(k), now.get(k)) for k in now if k in saved and saved.get(k) != now.get(k)}
    strict = {k: v for k, v in diffs.items() if k in _STRICT_KEYS}
    if strict and load_optimizer:
        raise IncompatibleCheckpointFoundError(
            "the checkpoint was saved with a different configuration: "
            + ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(strict.items()))
            + "; load with load_optimizer=False to take only the model weights")
    if diffs and state.groups.rank == 0:
        warnings.warn(f"checkpoint config differs from the current one: {diffs}", stacklevel=3)


_HF_WEIGHTS_NAME = "pytorch_model.bin"
_HF_SAFE_WEIGHTS = "model.safetensors"


def _load_full(path: str, tag: str, trust: bool | None) -> tuple[dict, bool]:
    """The full model state dict ``path/tag``, and whether it came from a Hugging Face safetensors
    checkpoint (whose tied weights are stored once and must be filled in before a strict load).

    transformers >= 5 saves only safetensors (``model.safetensors`` or its sharded index) yet its
    Trainer still resumes SMP runs with ``tag="pytorch_model.bin"``: when that file is absent, the
    safetensors files beside it are read instead.
    """
    file = os.path.join(path, tag)
    if os.path.exists(file) and not file.endswith(".safetensors"):
        return _load(file, trust=trust), False
    if os.path.exists(file):
        files = [file]
    elif tag == _HF_WEIGHTS_NAME and os.path.exists(os.path.join(path, _HF_SAFE_WEIGHTS)):
        files = [os.path.join(path, _HF_SAFE_WEIGHTS)]
    elif tag == _HF_WEIGHTS_NAME and os.path.exists(os.path.join(path, _HF_SAFE_WEIGHTS + ".index.json")):
        with open(os.path.join(path, _HF_SAFE_WEIGHTS + ".index.json")) as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
        files = [os.path.join(path, name) for name in shards]
    else:
        raise SMPCheckpointError(f"full checkpoint {file} does not exist")
    from safetensors.torch import load_file

    sd: dict = {}
    for name in files:
        sd.update(load_file(name, device="cpu"))
    return sd, True


def _fill_tied(sd: dict, module: torch.nn.Module) -> dict:
    """Add the keys of tied parameters (one tensor under several names) that ``sd`` stores once."""
    by_storage: dict[tuple, list[str]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if tensor.data_ptr() != 0:  # empty and meta tensors share address 0 without being tied
            by_storage.setdefault((tensor.data_ptr(), tuple(tensor.shape), tensor.dtype), []).append(key)
    filled = dict(sd)
    for aliases in by_storage.values():
        present = [k for k in aliases if k in filled]
        for key in aliases:
            if key not in filled and present:
                filled[key] = filled[present[0]]
    return filled


def _apply_model(sd: dict, strict: bool, translate_function: Callable | None, tied: bool = False) -> None:
    def apply(model: Any) -> None:
        loaded = _fill_tied(sd, model.get_module()) if tied else sd
        model.load_state_dict(loaded, strict=strict, translate_function=translate_function)

    if state.model is not None:
        state.model.defer_load(apply)
    else:
        state.pending_model_load = apply


def _apply_optimizer(sd: dict) -> None:
    if state.optimizer is not None:
        state.optimizer.load_state_dict(sd)
    else:
        state.pending_optimizer_load = lambda opt: opt.load_state_dict(sd)


def resume_from_checkpoint(path: str, tag: str | None = None, partial: bool = True, strict: bool = True,
                           load_optimizer: bool = True, load_sharded_optimizer_state: bool = True,
                           translate_function: Callable | None = None,
                           load_optimizer_states: bool | None = None, trust_checkpoint: bool | None = None) -> Any:
    """Load a checkpoint written by ``save_checkpoint``; returns its ``user_content`` (or None).

    Model and optimizer that do not exist yet receive their state when they are created.
    ``load_optimizer_states`` is SMP 1.10's name for ``load_optimizer``. Files are read without running code
    from them (:mod:`safe_load`); ``trust_checkpoint=True`` (an smp2ds addition; default: the
    ``SMP2DS_TRUST_CHECKPOINTS`` environment switch) reads them with ``weights_only=False``.
    """
    state.require()
    if load_optimizer_states is not None:
        load_optimizer = load_optimizer_states
    if not partial:
        if tag is None:
            raise SMPCheckpointError("resume_from_checkpoint(partial=False) needs the tag of the full checkpoint")
        sd, tied = _load_full(path, tag, trust_checkpoint)
        _apply_model(sd, strict, translate_function, tied)
        content = os.path.join(path, names.full_user_content(tag))
        return _load(content, True, trust_checkpoint) if os.path.exists(content) else None
    if tag is None:
        marker = os.path.join(path, names.NEWEST)
        if not os.path.exists(marker):
            raise SMPCheckpointError(f"no tag given and {marker} does not exist")
        with open(marker) as handle:
            entries = [ln.strip() for ln in handle if ln.strip()]
        if not entries:
            raise SMPCheckpointError(f"{marker} is empty")
        entry = entries[-1]
    else:
        entry = names.partial_entry(tag)
        if not os.path.isdir(os.path.join(path, entry)) and os.path.isdir(os.path.join(path, tag)):
            entry = tag  # SMP's sharded-data-parallel layout names the folder by the tag alone
    directory = commit.resolve_dir(path, entry)
    _check_config(directory, load_optimizer, trust_checkpoint)
    if sdp_files.is_sdp_dir(directory):
        return _resume_sdp(directory, strict, load_optimizer, translate_function, trust_checkpoint)
    files = checkpoint_verify.files_to_load(directory, _model_file(directory), load_optimizer,
                                            lambda sharded: _optimizer_file(directory, sharded))
    _apply_model(_load(files["model"], trust=trust_checkpoint), strict, translate_function)
    if "optimizer" in files:
        _apply_optimizer(_load(files["optimizer"], trust=trust_checkpoint))
    return _load(files["user_content"], True, trust_checkpoint) if "user_content" in files else None


def _resume_sdp(directory: str, strict: bool, load_optimizer: bool, translate_function: Callable | None,
                trust: bool | None) -> Any:
    """Resume a folder in SMP's sharded-data-parallel layout, written by smp2ds or by SMP.

    Whole tensors of ``model_0.pt``'s ``module`` load into the model; SMP's empty placeholders of partitioned
    parameters are skipped, their values coming from the master weights of this rank's ``optimizer_<s>.pt``
    (DeepSpeed copies them into the parameters when it loads the optimizer state).
    """
    layout = _sdp_layout()
    shard = layout.shard_rank if layout is not None else 0
    model_path = os.path.join(directory, names.SDP_MODEL)
    optimizer_path = os.path.join(directory, names.sdp_optimizer_file(shard))
    if load_optimizer and layout is None:
        topo = state.groups.topology
        raise IncompatibleCheckpointFoundError(
            f"checkpoint {directory} is in SMP's sharded-data-parallel layout (model_0.pt, optimizer_<s>.pt): its "
            "optimizer state resumes only under sharded_data_parallel_degree > 1 at tensor_parallel_degree 1 and "
            f"pipeline_parallel_degree 1 (this run: tp {topo.tp}, pp {topo.pp}, no shard groups); re-cut it with "
            "`smp2ds checkpoint reshard`, or load with load_optimizer=False to take only the model weights")
    files = checkpoint_verify.files_to_load(directory, model_path, load_optimizer, lambda sharded: optimizer_path)
    try:
        whole, placeholders = sdp_files.split_module(_load(files["model"], trust=trust))
    except ValueError as exc:
        raise SMPCheckpointError(f"{files['model']}: {exc}") from None
    if placeholders and not load_optimizer:
        raise SMPCheckpointError(
            f"{files['model']} holds {len(placeholders)} parameter(s) only as empty placeholders (SMP kept their "
            f"values in the optimizer files' master weights), e.g. {placeholders[0]!r}: resume with "
            "load_optimizer=True, or rebuild the weights offline with `smp2ds checkpoint consolidate`")
    if "optimizer" in files:
        body = _load(files["optimizer"], trust=trust)
        count = sdp_files.partition_count(body.get("ds_optimizer", body))
        if layout is not None and count != layout.shard_size:
            raise IncompatibleCheckpointFoundError(
                f"{files['optimizer']} is partitioned over {count} ranks but this run's sharded_data_parallel_degree "
                f"is {layout.shard_size}; re-cut it with `smp2ds checkpoint reshard --sdp {layout.shard_size}`, or "
                "load with load_optimizer=False to take only the model weights")
    whole[names.PARTIAL_MARK] = True  # names as the model holds them: no Hugging Face translation on load
    _apply_model(whole, strict and not placeholders, translate_function)
    if "optimizer" in files:
        _apply_optimizer(sdp_files.engine_optimizer_state(body))
    return _load(files["user_content"], True, trust) if "user_content" in files else None
