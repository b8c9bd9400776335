"""``smp.save`` / ``smp.load``: SMP's per-rank file naming, written atomically.

Partial files are named ``f"{f}_{pp_rank}_{tp_rank}.pt"`` (``v3``: ``f"{f}_{pp}_{tp}_{rdp}.pt"``);
``load`` finds this rank's file from the same ``f`` and checks the set of parts matches the
current degrees. SMP 1.7 wrote the names without ``.pt`` (``back_compat=True`` reads those) and
pre-1.6 SMP wrote one file per model-parallel rank, ``f"{f}_{mp_rank}"``.

Every write goes to a hidden temporary file in the same directory and is then ``os.replace``d,
so a crash never leaves a truncated checkpoint under the real name.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from smp2ds.engine.core import safe_load
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import (
    IncompatibleCheckpointFoundError,
    IncompatibleCheckpointRankFoundError,
    MissingCheckpointFilesError,
    SMPInvalidArgumentError,
)

_TMP_PREFIX = ".smp2ds-tmp-"


def readable_mode() -> int:
    """The mode ``open()`` would give a new file (0o666 minus the umask), as ``torch.save`` does.

    ``tempfile.mkstemp`` creates files ``-rw-------``; a checkpoint renamed from one would be
    unreadable to a serving container or a colleague's account.
    """
    mask = _current_umask()
    return 0o666 & ~mask


def _current_umask() -> int:
    try:
        with open("/proc/self/status") as handle:  # Linux: read without changing it
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(directory: str) -> None:
    """Make renames and new names inside ``directory`` durable (no-op where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=directory)
    try:
        os.fchmod(fd, readable_mode())
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def atomic_torch_save(obj: Any, path: str, **kwargs: Any) -> None:
    """``torch.save`` to a temporary sibling, fsync, then rename over ``path``."""
    _atomic_write(path, lambda handle: torch.save(obj, handle, **kwargs))


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically and durably (same mode rules as :func:`atomic_torch_save`)."""
    _atomic_write(path, lambda handle: handle.write(text.encode()))


def partial_name(f: str, v3: bool = False, suffix: str = ".pt") -> str:
    """This rank's partial file name for ``f``."""
    c = state.groups.coords
    parts = [c.pp_rank, c.tp_rank] + ([c.rdp_rank] if v3 else [])
    return f"{f}_{'_'.join(map(str, parts))}{suffix}"


def save(obj: Any, f: str, partial: bool = True, v3: bool = False, **kwargs: Any) -> None:
    """``smp.save``: every caller writes its own part (partial) or rank 0 writes ``f`` (full)."""
    state.require()
    if partial:
        shard = _optimizer_shard(obj)
        if shard is not None and not v3:
            raise SMPInvalidArgumentError(
                f"smp.save({f!r}, partial=True) of a sharded optimizer state (rdp_rank {shard[0]} of {shard[1]}) "
                f"without v3=True: every rdp rank would write {partial_name(f)} and only the last shard would "
                "survive; pass v3=True (SMP: use v3 with shard_optimizer_state / sharded data parallelism) so each "
                "rank writes its own file")
        atomic_torch_save(obj, partial_name(f, v3), **kwargs)
    elif state.groups.rank == 0:
        atomic_torch_save(obj, f, **kwargs)


def _parts(f: str, back_compat: bool) -> dict[tuple[int, ...], str]:
    pattern = re.compile(
        re.escape(os.path.basename(f)) + r"_(\d+(?:_\d+){0,2})" + ("" if back_compat else r"\.pt") + "$"
    )
    found: dict[tuple[int, ...], str] = {}
    for path in glob.glob(glob.escape(f) + "_*"):
        name = os.path.basename(path)
        if name.startswith(_TMP_PREFIX) or ".sagemaker-" in name:
            continue
        match = pattern.match(name)
        if match:
            found[tuple(int(x) for x in match.group(1).split("_"))] = path
    return found


def partial_path(f: str, back_compat: bool = False) -> str:
    """The file of this rank among ``f``'s parts, after checking the parts fit this run."""
    found = _parts(f, back_compat)
    if not found:
        raise MissingCheckpointFilesError(f"no checkpoint parts named {f}_*{'' if back_compat else '.pt'} were found")
    lengths = {len(k) for k in found}
    if len(lengths) != 1:
        raise IncompatibleCheckpointFoundError(f"checkpoint parts of {f} mix naming schemes: {sorted(found)}")
    width = lengths.pop()
    topo, c = state.groups.topology, state.groups.coords
    if width == 1:
        expected, mine = topo.mp, (c.mp_rank,)
    elif width == 2:
        expected, mine = topo.pp * topo.tp, (c.pp_rank, c.tp_rank)
    else:
        expected, mine = topo.world_size, (c.pp_rank, c.tp_rank, c.rdp_rank)
    limits = (topo.pp, topo.tp, topo.rdp)[:width] if width > 1 else (topo.mp,)
    bad = sorted(k for k in found if any(i >= n for i, n in zip(k, limits)))
    if bad:
        raise IncompatibleCheckpointRankFoundError(
            f"checkpoint {f} has part(s) {bad} that do not exist with pipeline_parallel_degree={topo.pp}, "
            f"tensor_parallel_degree={topo.tp}, rdp={topo.rdp}"
        )
    if len(found) != expected:
        raise MissingCheckpointFilesError(
            f"checkpoint {f} has {len(found)} part(s) but this run needs {expected}; found {sorted(found)}"
        )
    return found[mine]


def load(f: str, partial: bool = True, back_compat: bool = False, **kwargs: Any) -> Any:
    """``smp.load``: this rank's part of a partial checkpoint, or the full file ``f``.

    The file is read without running code from it (:mod:`safe_load`: tensors, DeepSpeed's optimizer state and the
    types SMP scripts save); ``weights_only=False`` (or ``SMP2DS_TRUST_CHECKPOINTS=1``) trusts it, as
    ``torch.load`` does. Other ``kwargs`` go to ``torch.load``.
    """
    state.require()
    weights_only = kwargs.pop("weights_only", None)
    path = partial_path(f, back_compat) if partial else f
    obj = safe_load.load(path, user_content=True, trust=None if weights_only is None else not weights_only,
                         **kwargs)
    shard = _optimizer_shard(obj) if partial else None
    if shard is not None:
        c, topo = state.groups.coords, state.groups.topology
        if shard != (c.rdp_rank, topo.rdp):
            raise IncompatibleCheckpointRankFoundError(
                f"{path} holds the optimizer shard of rdp_rank {shard[0]} of {shard[1]}, but this rank is rdp_rank "
                f"{c.rdp_rank} of {topo.rdp}: loading it would give this rank another rank's optimizer state. Save "
                "sharded optimizer state with smp.save(..., partial=True, v3=True) and load it with the same "
                "data-parallel layout")
    return obj


def _optimizer_shard(obj: Any) -> tuple[int, int] | None:
    """``(rdp_rank, rdp_size)`` when ``obj`` is one rank's part of a sharded optimizer state
    (``DistributedOptimizer.local_state_dict()`` under ZeRO / sharded data parallelism)."""
    if not isinstance(obj, dict) or "ds_optimizer" not in obj or not isinstance(obj.get("smp2ds"), dict):
        return None
    meta = obj["smp2ds"]
    if int(meta.get("zero_stage", 0)) < 1 or int(meta.get("rdp_size", 1)) < 2:
        return None
    return int(meta.get("rdp_rank", 0)), int(meta["rdp_size"])
