"""A partial checkpoint directory is whole or absent: staged, sealed by a manifest, renamed.

``save_checkpoint(partial=True)`` used to write straight into ``<tag>_partial``; a crash part-way
left weights of one save next to optimizer state of another. Now (shared filesystem assumed, as
SMP did: rank 0 sees every rank's files):

1. Rank 0 tidies ``path`` first: leftovers of an earlier crashed save are deleted, or rolled
   forward when one is the only complete copy of a checkpoint (see step 4).
2. Every rank writes its files into ``path/.smp2ds-stage-<entry>-<nonce>/`` (fsynced) and
   reports name, size, SHA-256 and its rank.
3. Rank 0 writes the manifest (files, sizes, digests, writer ranks, layout) *last*; a
   directory is complete exactly when its manifest exists.
4. An existing ``<entry>`` (same tag saved again) is moved aside to ``.smp2ds-old-...``, the
   stage is renamed to ``<entry>``, and the parent directory fsynced. A crash between the two
   renames leaves two complete hidden copies; loading and the next save use the newer one.
5. ``newest`` is rewritten atomically and fsynced.
6. Only then are checkpoints beyond ``num_kept_partial_checkpoints`` and the aside copy renamed
   to ``.smp2ds-trash-...`` (atomic) and deleted, so a crash mid-delete never leaves a
   half-deleted directory under a name ``newest`` or a user could pick.

``SMP2DS_FAULT_POINT`` (a name from :data:`FAULT_POINTS`) kills this process with SIGKILL at
that point of a save, on the ranks listed in ``SMP2DS_FAULT_RANKS`` (comma-separated; default
every rank). It exists for the crash tests and costs one environment lookup per point.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
import warnings
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from smp2ds.engine.core.checkpoint_format import MANIFEST, NEWEST
from smp2ds.engine.core.save_load import atomic_write_text, fsync_dir, readable_mode
from smp2ds.engine.exceptions import MissingCheckpointFilesError, SMPCheckpointError, SMPInvalidArgumentError

MANIFEST_FORMAT = 1
STAGE, ASIDE, TRASH = ".smp2ds-stage-", ".smp2ds-old-", ".smp2ds-trash-"
_HIDDEN = (STAGE, ASIDE, TRASH)
_TMP_FILE = ".smp2ds-tmp-"
FAULT_POINTS = ("files_written", "manifest_written", "old_moved_aside", "renamed", "newest_written",
                "deleting_old")


def fault_point(name: str, rank: int) -> None:
    """Die here (SIGKILL, no clean-up) when ``SMP2DS_FAULT_POINT`` names this point (crash tests)."""
    chosen = os.environ.get("SMP2DS_FAULT_POINT", "")
    if not chosen:
        return
    if chosen not in FAULT_POINTS:
        raise SMPInvalidArgumentError(f"environment variable SMP2DS_FAULT_POINT={chosen!r} names no fault point; "
                                      f"allowed: {', '.join(FAULT_POINTS)}, or unset")
    ranks = os.environ.get("SMP2DS_FAULT_RANKS", "").strip()
    if ranks and not all(r.strip().isdigit() for r in ranks.split(",")):
        raise SMPInvalidArgumentError(f"environment variable SMP2DS_FAULT_RANKS={ranks!r} is not a list of ranks; "
                                      "allowed: comma-separated rank numbers, e.g. 0,1")
    if chosen != name or (ranks and str(rank) not in {r.strip() for r in ranks.split(",")}):
        return
    os.kill(os.getpid(), signal.SIGKILL)


# ---- writing files ---------------------------------------------------------------------------
class _HashingWriter:
    """File-like object handed to ``torch.save``: counts and hashes the bytes as they go out."""

    def __init__(self, handle: BinaryIO):
        self.handle, self.size, self.digest = handle, 0, hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as its writer saw it."""

    name: str
    size: int
    sha256: str
    rank: int


def write_file(obj: Any, directory: str, name: str, rank: int) -> FileRecord:
    """``torch.save`` ``obj`` to ``directory/name`` (fsynced, umask-honouring mode) and describe it."""
    path = os.path.join(directory, name)
    with open(path, "wb") as handle:
        writer = _HashingWriter(handle)
        torch.save(obj, writer)
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(path, readable_mode())
    return FileRecord(name, writer.size, writer.digest.hexdigest(), rank)


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- the hidden names ------------------------------------------------------------------------
def stage_dir(path: str, entry: str, nonce: str) -> str:
    return os.path.join(path, f"{STAGE}{entry}-{nonce}")


def _hidden_entry(name: str) -> tuple[str, str] | None:
    """``(prefix, entry)`` of one of our hidden directory names, else None."""
    for prefix in _HIDDEN:
        if name.startswith(prefix) and "-" in name[len(prefix):]:
            return prefix, name[len(prefix):].rsplit("-", 1)[0]
    return None


def read_manifest(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, MANIFEST)) as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SMPCheckpointError(f"{os.path.join(directory, MANIFEST)} is unreadable: {exc}") from exc


def _complete(directory: str) -> dict[str, Any] | None:
    """The manifest of ``directory`` when every file it lists is there with its size, else None."""
    try:
        manifest = read_manifest(directory)
    except SMPCheckpointError:
        return None
    if manifest is None:
        return None
    for name, rec in manifest.get("files", {}).items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file) or os.path.getsize(file) != rec["size"]:
            return None
    return manifest


def _best_hidden_copy(path: str, entry: str) -> str | None:
    """The newest complete staged or set-aside copy of ``entry`` (left by a crash mid-rename)."""
    best, best_time = None, -1
    for name in os.listdir(path):
        hidden = _hidden_entry(name)
        if hidden is None or hidden[0] == TRASH or hidden[1] != entry:
            continue
        manifest = _complete(os.path.join(path, name))
        if manifest is not None and manifest.get("saved_at_ns", 0) > best_time:
            best, best_time = os.path.join(path, name), manifest.get("saved_at_ns", 0)
    return best


def resolve_dir(path: str, entry: str) -> str:
    """The directory to load ``entry`` from: itself, or the complete copy a crash left hidden."""
    final = os.path.join(path, entry)
    if os.path.isdir(final):
        return final
    hidden = _best_hidden_copy(path, entry) if os.path.isdir(path) else None
    if hidden is None:
        raise SMPCheckpointError(f"partial checkpoint directory {final} does not exist")
    warnings.warn(f"{final} is missing (a save was interrupted while replacing it); loading the complete "
                  f"copy {hidden}", stacklevel=3)
    return hidden


def tidy(path: str) -> None:
    """Remove what a crashed save left in ``path``; roll a lone complete copy forward into place."""
    if not os.path.isdir(path):
        return
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        hidden = _hidden_entry(name)
        if hidden is not None and os.path.isdir(full):
            prefix, entry = hidden
            final = os.path.join(path, entry)
            if prefix != TRASH and not os.path.exists(final) and _best_hidden_copy(path, entry) == full:
                os.rename(full, final)
                continue
            _delete_dir(path, full)
        elif name.startswith(_TMP_FILE) and os.path.isfile(full):
            os.unlink(full)
    fsync_dir(path)


def _delete_dir(path: str, directory: str) -> None:
    """Rename to a trash name first (atomic), then delete: a crash never leaves a half directory
    under a name anything would load."""
    name = os.path.basename(directory)
    if not name.startswith(TRASH):
        hidden = _hidden_entry(name)
        entry = hidden[1] if hidden else name
        trash = os.path.join(path, f"{TRASH}{entry}-{os.urandom(8).hex()}")
        os.rename(directory, trash)
        directory = trash
    shutil.rmtree(directory, ignore_errors=True)


# ---- sealing and publishing (rank 0) -----------------------------------------------------------
def seal(path: str, entry: str, stage: str, records: list[FileRecord], layout: dict[str, Any], tag: str,
         version: str, keep: int | None, single_newest: bool = False) -> None:
    """Steps 3-6 of the module docstring, on rank 0 after every rank has written its files.

    ``single_newest``: ``newest`` names this entry alone (SMP's sharded-data-parallel layout, whose readers take
    the whole file as one tag); the entries kept are then the complete folders by save time.
    """
    missing = [r.name for r in records if not os.path.isfile(os.path.join(stage, r.name))]
    if missing:
        raise MissingCheckpointFilesError(f"checkpoint files {missing} written by other ranks are not visible in "
                                          f"{stage}; save_checkpoint needs a filesystem shared by all ranks")
    manifest = {
        "format": MANIFEST_FORMAT, "entry": entry, "tag": tag, "smp_version": version,
        "saved_at_ns": time.time_ns(), "layout": layout,
        "files": {r.name: {"size": r.size, "sha256": r.sha256, "rank": r.rank} for r in records},
    }
    atomic_write_text(os.path.join(stage, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    fault_point("manifest_written", 0)
    final = os.path.join(path, entry)
    aside = None
    if os.path.exists(final):
        aside = os.path.join(path, f"{ASIDE}{entry}-{os.urandom(8).hex()}")
        os.rename(final, aside)
        fault_point("old_moved_aside", 0)
    os.rename(stage, final)
    fsync_dir(path)
    fault_point("renamed", 0)
    dropped = _publish_single(path, entry, keep) if single_newest else _publish_newest(path, entry, keep)
    fault_point("newest_written", 0)
    for old in ([aside] if aside else []) + [os.path.join(path, d) for d in dropped]:
        if os.path.isdir(old):
            _delete_dir(path, old)
            fault_point("deleting_old", 0)
    fsync_dir(path)


def _publish_newest(path: str, entry: str, keep: int | None) -> list[str]:
    """Append ``entry`` to ``newest`` (durably); return the entries that fell out of it."""
    marker = os.path.join(path, NEWEST)
    lines: list[str] = []
    if os.path.exists(marker):
        with open(marker) as handle:
            lines = [ln.strip() for ln in handle if ln.strip() and ln.strip() != entry]
    lines.append(entry)
    dropped: list[str] = []
    if keep is not None and keep > 0:
        dropped, lines = lines[:-keep], lines[-keep:]
    atomic_write_text(marker, "\n".join(lines) + "\n")
    return dropped


def _publish_single(path: str, entry: str, keep: int | None) -> list[str]:
    """Write ``newest`` as ``entry`` alone (durably); return the older complete single-newest saves beyond ``keep``."""
    atomic_write_text(os.path.join(path, NEWEST), entry + "\n")
    if keep is None or keep <= 0:
        return []
    saved: list[tuple[int, str]] = []
    for name in os.listdir(path):
        manifest = _complete(os.path.join(path, name)) if os.path.isdir(os.path.join(path, name)) else None
        if manifest is not None and manifest.get("entry") == name and manifest.get("layout", {}).get("smp_sdp_layout"):
            saved.append((int(manifest.get("saved_at_ns", 0)), name))
    older = [name for _, name in sorted(saved) if name != entry]
    return older[: max(0, len(older) - (keep - 1))]
