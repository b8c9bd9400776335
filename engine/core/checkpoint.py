"""``smp.save_checkpoint`` / ``smp.resume_from_checkpoint`` (SMP 1.10+ layout).

::

    path/
      <tag>_partial/                          partial=True
        model_<pp>_<tp>.pt                    rdp_rank 0: model.local_state_dict()
        optimizer_states_<pp>_<tp>[_<rdp>].pt rdp_rank 0, or every rank with shard_optimizer_state
        user_content.pt, smp_config.pt        rank 0
      <tag>, user_content_<tag>               partial=False: full model state dict (rank 0)
      newest                                  one "<tag>_partial" per line, last = newest

fp16 loss-scaler and master-weight state travel inside the optimizer file (DeepSpeed keeps
them in its optimizer state), so no separate ``fp16_states_*`` file is written.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import torch

from smp2ds.engine.core import object_collectives as collectives
from smp2ds.engine.core.ranks import CommGroup
from smp2ds.engine.core.save_load import atomic_torch_save, atomic_write_text
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import IncompatibleCheckpointFoundError, SMPCheckpointError

SMP2DS_CHECKPOINT_VERSION = "1.15.0"
_STRICT_KEYS = ("pipeline_parallel_degree", "tensor_parallel_degree", "shard_optimizer_state",
                "sharded_data_parallel_degree")


def _coords() -> Any:
    return state.groups.coords


def _optimizer_file(directory: str, sharded: bool) -> str:
    c = _coords()
    suffix = f"_{c.rdp_rank}" if sharded else ""
    return os.path.join(directory, f"optimizer_states_{c.pp_rank}_{c.tp_rank}{suffix}.pt")


def _model_file(directory: str) -> str:
    c = _coords()
    return os.path.join(directory, f"model_{c.pp_rank}_{c.tp_rank}.pt")


def _load(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def save_checkpoint(path: str, tag: str, partial: bool = True, model: Any = None, optimizer: Any = None,
                    user_content: Any = None, translate_if_full: bool = True,
                    num_kept_partial_checkpoints: int | None = None) -> None:
    """Write a partial (per-rank) or full checkpoint; collective over all ranks."""
    state.require()
    if not isinstance(tag, str):
        raise SMPCheckpointError(f"tag must be a str, got {type(tag).__name__}")
    tags = collectives.allgather(tag, CommGroup.WORLD)
    if len(set(tags)) != 1:
        raise SMPCheckpointError(f"save_checkpoint tag differs between ranks: {tags}")
    rank, c = state.groups.rank, _coords()
    if partial:
        directory = os.path.join(path, f"{tag}_partial")
        # Some backends gather parameters for local_state_dict (collective): then every rank calls it.
        if model is not None and (c.rdp_rank == 0 or model.backend.collective_state_dict):
            sd = model.local_state_dict()
            if c.rdp_rank == 0:
                atomic_torch_save(sd, _model_file(directory))
        if optimizer is not None:
            sharded = bool(optimizer.backend.optimizer_state_is_sharded)
            if sharded or c.rdp_rank == 0:
                atomic_torch_save(optimizer.local_state_dict(), _optimizer_file(directory, sharded))
        if rank == 0:
            if user_content is not None:
                atomic_torch_save(user_content, os.path.join(directory, "user_content.pt"))
            atomic_torch_save({**state.cfg.get_config_dict(), "smp_version": SMP2DS_CHECKPOINT_VERSION},
                              os.path.join(directory, "smp_config.pt"))
        collectives.barrier()
        if rank == 0:
            _record_newest(path, f"{tag}_partial", num_kept_partial_checkpoints)
    else:
        if optimizer is not None:
            warnings.warn("save_checkpoint(partial=False) saves only the model; the optimizer is skipped (SMP "
                          "semantics); use partial=True to keep optimizer state", stacklevel=2)
        if model is not None:
            sd = model.state_dict()
            if translate_if_full and state.module_manager.translate_functions:
                for smp_to_hf, _ in state.module_manager.translate_functions:
                    sd = smp_to_hf(sd)
            else:
                sd["_smp_is_partial"] = False
            if rank == 0:
                atomic_torch_save(sd, os.path.join(path, tag))
        if rank == 0 and user_content is not None:
            atomic_torch_save(user_content, os.path.join(path, f"user_content_{tag}"))
    collectives.barrier()


def _record_newest(path: str, entry: str, keep: int | None) -> None:
    marker = os.path.join(path, "newest")
    lines = []
    if os.path.exists(marker):
        with open(marker) as handle:
            lines = [ln.strip() for ln in handle if ln.strip() and ln.strip() != entry]
    lines.append(entry)
    if keep is not None and keep > 0:
        for old in lines[:-keep]:
            shutil.rmtree(os.path.join(path, old), ignore_errors=True)
        lines = lines[-keep:]
    atomic_write_text(marker, "\n".join(lines) + "\n")


def _check_config(directory: str, load_optimizer: bool) -> None:
    if os.environ.get("SMP_VERIFY_CHECKPOINT_CONFIG", "1") == "0":
        return
    cfg_path = os.path.join(directory, "smp_config.pt")
    if not os.path.exists(cfg_path):
        return
    saved, now = _load(cfg_path), state.cfg.get_config_dict()
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


def _load_full(path: str, tag: str) -> tuple[dict, bool]:
    """The full model state dict ``path/tag``, and whether it came from a Hugging Face safetensors
    checkpoint (whose tied weights are stored once and must be filled in before a strict load).

    transformers >= 5 saves only safetensors (``model.safetensors`` or its sharded index) yet its
    Trainer still resumes SMP runs with ``tag="pytorch_model.bin"``: when that file is absent, the
    safetensors files beside it are read instead.
    """
    file = os.path.join(path, tag)
    if os.path.exists(file) and not file.endswith(".safetensors"):
        return _load(file), False
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
        loaded = _fill_tied(sd, model.module) if tied else sd
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
                           load_optimizer_states: bool | None = None) -> Any:
    """Load a checkpoint written by ``save_checkpoint``; returns its ``user_content`` (or None).

    Model and optimizer that do not exist yet receive their state when they are created.
    ``load_optimizer_states`` is SMP 1.10's name for ``load_optimizer``.
    """
    state.require()
    if load_optimizer_states is not None:
        load_optimizer = load_optimizer_states
    if not partial:
        if tag is None:
            raise SMPCheckpointError("resume_from_checkpoint(partial=False) needs the tag of the full checkpoint")
        sd, tied = _load_full(path, tag)
        _apply_model(sd, strict, translate_function, tied)
        content = os.path.join(path, f"user_content_{tag}")
        return _load(content) if os.path.exists(content) else None
    if tag is None:
        marker = os.path.join(path, "newest")
        if not os.path.exists(marker):
            raise SMPCheckpointError(f"no tag given and {marker} does not exist")
        with open(marker) as handle:
            entries = [ln.strip() for ln in handle if ln.strip()]
        if not entries:
            raise SMPCheckpointError(f"{marker} is empty")
        directory = os.path.join(path, entries[-1])
    else:
        directory = os.path.join(path, tag if tag.endswith("_partial") else f"{tag}_partial")
    if not os.path.isdir(directory):
        raise SMPCheckpointError(f"partial checkpoint directory {directory} does not exist")
    _check_config(directory, load_optimizer)
    model_file = _model_file(directory)
    if not os.path.exists(model_file):
        raise SMPCheckpointError(f"{model_file} is missing")
    _apply_model(_load(model_file), strict, translate_function)
    if load_optimizer:
        expect = bool(state.cfg.shard_optimizer_state) or int(state.cfg.sharded_data_parallel_degree) > 1
        for sharded in (expect, not expect):
            opt_file = _optimizer_file(directory, sharded)
            if os.path.exists(opt_file):
                _apply_optimizer(_load(opt_file))
                break
        else:
            warnings.warn(f"no optimizer state for this rank in {directory}; optimizer starts fresh", stacklevel=2)
    content = os.path.join(directory, "user_content.pt")
    return _load(content) if os.path.exists(content) else None
