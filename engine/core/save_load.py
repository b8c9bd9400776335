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
from typing import Any

import torch

from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import (
    IncompatibleCheckpointFoundError,
    IncompatibleCheckpointRankFoundError,
    MissingCheckpointFilesError,
)

_TMP_PREFIX = ".smp2ds-tmp-"


def atomic_torch_save(obj: Any, path: str, **kwargs: Any) -> None:
    """``torch.save`` to a temporary sibling, then rename over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(obj, handle, **kwargs)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=directory)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def partial_name(f: str, v3: bool = False, suffix: str = ".pt") -> str:
    """This rank's partial file name for ``f``."""
    c = state.groups.coords
    parts = [c.pp_rank, c.tp_rank] + ([c.rdp_rank] if v3 else [])
    return f"{f}_{'_'.join(map(str, parts))}{suffix}"


def save(obj: Any, f: str, partial: bool = True, v3: bool = False, **kwargs: Any) -> None:
    """``smp.save``: every caller writes its own part (partial) or rank 0 writes ``f`` (full)."""
    state.require()
    if partial:
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

    Checkpoints may hold arbitrary pickled objects (optimizer and loss-scaler state), as SMP's
    did, so ``weights_only`` defaults to False; load only checkpoints you trust.
    """
    state.require()
    kwargs.setdefault("weights_only", False)
    kwargs.setdefault("map_location", "cpu")
    path = partial_path(f, back_compat) if partial else f
    return torch.load(path, **kwargs)
