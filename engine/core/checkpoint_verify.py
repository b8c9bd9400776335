"""Before ``resume_from_checkpoint`` reads a partial checkpoint: is it whole, and does it fit this run?

With a manifest (checkpoints saved by smp2ds, see :mod:`checkpoint_commit`) every file this rank
will read must be listed, present, of the recorded size and SHA-256, and the saved layout must
match this run where the files depend on it (pipeline/tensor degrees always; the data-parallel
layout when the optimizer state is sharded). Without a manifest (a checkpoint written by SMP
itself) the files this rank needs must at least exist.

Whatever is missing or mismatched is an error naming it. ``load_optimizer=False`` is the
explicit opt-in to take the model weights only (the optimizer state is then not required).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from smp2ds.engine.core import checkpoint_commit as commit
from smp2ds.engine.core.checkpoint_format import USER_CONTENT
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import (
    IncompatibleCheckpointFoundError,
    IncompatibleCheckpointRankFoundError,
    MissingCheckpointFilesError,
    SMPCheckpointError,
)

_WEIGHTS_ONLY = "load with load_optimizer=False to take only the model weights"


def _current_layout() -> dict[str, int]:
    topo = state.groups.topology
    return {"world_size": topo.world_size, "pipeline_parallel_degree": topo.pp, "tensor_parallel_degree": topo.tp,
            "rdp": topo.rdp}


def _check_layout(directory: str, saved: dict[str, Any], load_optimizer: bool) -> None:
    now = _current_layout()
    diffs = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    text = ", ".join(f"{k}: saved {a}, now {b}" for k, (a, b) in diffs.items())
    if "pipeline_parallel_degree" in diffs or "tensor_parallel_degree" in diffs:
        raise IncompatibleCheckpointRankFoundError(
            f"checkpoint {directory} was saved with a different model-parallel layout ({text}); a partial "
            "checkpoint loads only with the same pipeline_parallel_degree and tensor_parallel_degree")
    if diffs and load_optimizer and saved.get("optimizer_sharded"):
        raise IncompatibleCheckpointFoundError(
            f"checkpoint {directory} holds optimizer state sharded over a different data-parallel layout "
            f"({text}); {_WEIGHTS_ONLY}")


def _verify_file(directory: str, name: str, manifest: dict[str, Any]) -> str:
    path = os.path.join(directory, name)
    record = manifest.get("files", {}).get(name)
    if record is None:
        raise MissingCheckpointFilesError(
            f"checkpoint {directory} has no {name} for this rank (rank {state.groups.rank}); its manifest lists "
            f"{sorted(manifest.get('files', {}))}")
    if not os.path.isfile(path):
        raise MissingCheckpointFilesError(f"{path} is missing although the checkpoint's manifest lists it")
    size = os.path.getsize(path)
    if size != record["size"]:
        raise SMPCheckpointError(f"{path} has {size} bytes but the manifest recorded {record['size']}: the file "
                                 "was changed or truncated after the save")
    if commit.file_digest(path) != record["sha256"]:
        raise SMPCheckpointError(f"{path} does not match the SHA-256 recorded in the manifest: the file was "
                                 "changed or corrupted after the save")
    return path


def files_to_load(directory: str, model_file: str, load_optimizer: bool,
                  optimizer_file: Callable[[bool], str]) -> dict[str, str]:
    """Paths this rank reads (``model``, ``optimizer``, ``user_content``), after the checks above.

    ``optimizer_file(sharded)`` names this rank's optimizer file for either layout.
    """
    manifest = commit.read_manifest(directory)
    if manifest is None:
        return _legacy_files(directory, model_file, load_optimizer, optimizer_file)
    layout = manifest.get("layout", {})
    _check_layout(directory, layout, load_optimizer)
    files = {"model": _verify_file(directory, os.path.basename(model_file), manifest)}
    if load_optimizer:
        if not layout.get("optimizer_saved"):
            raise MissingCheckpointFilesError(
                f"checkpoint {directory} was saved without optimizer state; {_WEIGHTS_ONLY}")
        name = os.path.basename(optimizer_file(bool(layout.get("optimizer_sharded"))))
        files["optimizer"] = _verify_file(directory, name, manifest)
    if USER_CONTENT in manifest.get("files", {}):
        files["user_content"] = _verify_file(directory, USER_CONTENT, manifest)
    return files


def _legacy_files(directory: str, model_file: str, load_optimizer: bool,
                  optimizer_file: Callable[[bool], str]) -> dict[str, str]:
    """A checkpoint without a manifest (written by SMP): the files this rank needs must exist."""
    if not os.path.exists(model_file):
        raise MissingCheckpointFilesError(f"{model_file} is missing")
    files = {"model": model_file}
    if load_optimizer:
        settings = state.plan.engine_settings
        expect = settings.zero_stage >= 1 or settings.mics.enabled  # ZeRO-1 or sharded data parallelism
        candidates = [optimizer_file(expect), optimizer_file(not expect)]
        found = [c for c in candidates if os.path.exists(c)]
        if not found:
            raise MissingCheckpointFilesError(
                f"no optimizer state for this rank in {directory} (looked for "
                f"{', '.join(os.path.basename(c) for c in candidates)}); {_WEIGHTS_ONLY}")
        files["optimizer"] = found[0]
    content = os.path.join(directory, USER_CONTENT)
    if os.path.exists(content):
        files["user_content"] = content
    return files
