"""Partial model files of any pp x tp (x rdp, sdp) layout -> one full state dict, streamed.

Every model file is memory-mapped (``torch.load(mmap=True, weights_only=True)``): a tensor's
bytes are read only when it is joined. The plan (:func:`plan`) fixes every output tensor's name,
shape, dtype and cut before any byte is written; :func:`consolidate` then joins one tensor at a
time, writes it and drops it. The mapped files are let go every ``release_bytes`` read, so the
file pages this process keeps mapped (counted in its resident memory) stay bounded too.

Data-parallel replicas (rdp) hold identical weights and only rdp rank 0 writes model files; a
sharded-data-parallel run's model files already hold each tensor-parallel shard whole (gathered
over the shard group when saved), so only the pp x tp files are read.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from smp2ds.engine.checkpoint_tools import sdp_layout, shard_rules
from smp2ds.engine.checkpoint_tools.checkpoint_folder import CheckpointLayout, Problem
from smp2ds.engine.checkpoint_tools.reading import model_tensors
from smp2ds.engine.checkpoint_tools.safetensors_stream import StreamWriter
from smp2ds.engine.checkpoint_tools.shard_rules import Split
from smp2ds.engine.core.checkpoint_format import SDP_MODEL
from smp2ds.engine.exceptions import SMPCheckpointError
from smp2ds.engine.nn.parallel.shards import ShardSpec

DEFAULT_RELEASE_BYTES = 256 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of the full state dict: where its pieces are and how they join."""

    key: str
    files: tuple[str, ...]
    """The model files holding its pieces, by tensor-parallel rank (one file when it is whole)."""
    split: Split | None
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for extent in self.shape:
            n *= extent
        return n


class MappedFiles:
    """Files memory-mapped on first use (:meth:`_load`) and let go after ``release_bytes`` read through them: the
    file pages this process keeps mapped (counted in its resident memory) stay bounded."""

    def __init__(self, release_bytes: int = DEFAULT_RELEASE_BYTES):
        self.release_bytes = release_bytes
        self._open: dict[str, Any] = {}
        self._read = 0

    def _load(self, file: str) -> Any:
        raise NotImplementedError

    def _opened(self, file: str) -> Any:
        if file not in self._open:
            self._open[file] = self._load(file)
        return self._open[file]

    def _counted(self, tensor: torch.Tensor) -> torch.Tensor:
        self._read += tensor.nbytes
        return tensor

    def maybe_release(self, force: bool = False) -> None:
        """Drop the mappings once enough was read, or now with ``force`` (call with no piece still referenced)."""
        if force or self._read >= self.release_bytes:
            self._open.clear()
            self._read = 0


class ShardReader(MappedFiles):
    """Memory-mapped model files, opened on first use and let go after ``release_bytes`` read."""

    def _load(self, file: str) -> dict[str, torch.Tensor]:
        tensors = model_tensors(file, mmap=True)
        empty = [k for k, v in tensors.items() if v.numel() == 0]
        if empty and os.path.basename(file) == SDP_MODEL:  # SMP's placeholders: values in the master weights
            sdp_layout.fill_placeholders(os.path.dirname(file), tensors, empty)
        return tensors

    def tensors(self, file: str) -> dict[str, torch.Tensor]:
        return self._opened(file)

    def piece(self, file: str, key: str) -> torch.Tensor:
        return self._counted(self.tensors(file)[key])


def _stage_keys(layout: CheckpointLayout, reader: ShardReader, stage: int,
                problems: list[Problem]) -> list[tuple[str, list[str]]]:
    """``(key, files by tp rank)`` of one stage, after checking its tp files agree on keys and shapes."""
    files = layout.stage_files(stage)
    flagged = {p.file for p in layout.problems}
    if len(files) != layout.tp or flagged & set(files):
        return []  # already reported: comparing with a missing or foreign file would only add noise
    shapes: list[dict[str, tuple[tuple[int, ...], torch.dtype]]] = []
    for file in files:
        try:
            shapes.append({k: (tuple(v.shape), v.dtype) for k, v in reader.tensors(file).items()})
        except SMPCheckpointError as exc:
            problems.append(Problem(file, str(exc).split(": ", 1)[-1]))
            return []
    first = shapes[0]
    for rank, other in enumerate(shapes[1:], start=1):
        extra, missing = sorted(set(other) - set(first)), sorted(set(first) - set(other))
        if extra or missing:
            problems.append(Problem(files[rank], f"holds other tensors than {os.path.basename(files[0])} of the same "
                                    f"stage (missing {missing[:4]}, extra {extra[:4]}): files of different models "
                                    "or saves"))
            return []
        bad = [k for k in first if other[k] != first[k]]
        if bad:
            k = bad[0]
            problems.append(Problem(files[rank], f"{k} has shape {list(other[k][0])} {other[k][1]} but "
                                    f"{list(first[k][0])} {first[k][1]} in {os.path.basename(files[0])}: tensor-"
                                    "parallel pieces of one tensor must match (files of different saves?)"))
            return []
    return [(k, files) for k in first]


def _decide(key: str, files: list[str], named: dict[str, Split | None], reader: ShardReader,
            problems: list[Problem]) -> tuple[bool, Split | None]:
    """(ok, split) for ``key``: by name where a rule covers it, else by comparing the pieces."""
    if len(files) == 1:
        return True, None
    if key in named:
        return True, named[key]
    pieces = [reader.piece(f, key) for f in files]
    same = all(torch.equal(pieces[0], p) for p in pieces[1:])
    del pieces
    reader.maybe_release()
    if same:
        return True, None
    if shard_rules.is_vocabulary(key):
        return True, Split(0)
    problems.append(Problem(files[1], f"{key} differs between tensor-parallel ranks and no rule says how it was "
                            "cut (a module smp2ds does not know, e.g. your own smp.nn.DistributedLinear); "
                            "consolidation refuses to guess"))
    return False, None


def plan(layout: CheckpointLayout, reader: ShardReader | None = None) -> tuple[list[Entry], list[Problem]]:
    """Every tensor of the full state dict, in stage order, and the problems found on the way."""
    reader = reader or ShardReader()
    problems: list[Problem] = []
    per_stage = [_stage_keys(layout, reader, s, problems) for s in range(layout.pp)]
    named = shard_rules.name_splits({k for stage in per_stage for k, _ in stage})
    entries: dict[str, Entry] = {}
    for stage in per_stage:
        for key, files in stage:
            ok, split = _decide(key, files, named, reader, problems)
            if not ok:
                continue
            piece = reader.tensors(files[0])[key]
            shape = list(piece.shape)
            if split is not None:
                if split.dim >= len(shape) or shape[split.dim] % split.blocks:
                    problems.append(Problem(files[0], f"{key} has shape {shape}, which does not split into "
                                            f"{split.blocks} block(s) along dimension {split.dim}"))
                    continue
                shape[split.dim] *= len(files)
            entry = Entry(key, tuple(files) if split is not None else (files[0],), split, tuple(shape), piece.dtype)
            previous = entries.get(key)
            if previous is None:
                entries[key] = entry  # a tied tensor on several stages: the first stage's copy
            elif previous.shape != entry.shape:
                problems.append(Problem(files[0], f"{key} has shape {list(entry.shape)} here but "
                                        f"{list(previous.shape)} in {os.path.basename(previous.files[0])}"))
    reader.maybe_release(force=True)  # the plan holds shapes only: the pages its comparisons read can go
    return list(entries.values()), problems


def join_pieces(pieces: list[torch.Tensor], split: Split | None) -> torch.Tensor:
    """The full tensor from its pieces by tensor-parallel rank, as ``ShardSpec.join`` does: a new tensor when pieces
    are joined, else the one piece itself (a whole tensor, or one the tensor-parallel ranks replicate). A mapped
    piece is mapped copy-on-write, so a caller may change it without touching the file; not copying it keeps one
    tensor's pages in memory instead of two (the largest, the word embedding, is hundreds of megabytes)."""
    if split is None or len(pieces) == 1:
        return pieces[0]
    return ShardSpec(split.dim, len(pieces), split.blocks).join(pieces)


def join(entry: Entry, reader: ShardReader) -> torch.Tensor:
    """The full tensor of ``entry`` (its mapping, or a joined copy: see :func:`join_pieces`)."""
    return join_pieces([reader.piece(f, entry.key) for f in entry.files], entry.split)


def checked_plan(layout: CheckpointLayout, reader: ShardReader) -> list[Entry]:
    """:func:`plan`, refusing a checkpoint with any problem (all of them listed, each with its file)."""
    if layout.problems:
        raise SMPCheckpointError(problem_text(layout.problems))
    entries, problems = plan(layout, reader)
    if problems:
        raise SMPCheckpointError(problem_text(problems))
    return entries


def iter_tensors(entries: list[Entry], reader: ShardReader) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, full tensor)`` one at a time, releasing mapped files as it goes."""
    for entry in entries:
        tensor = join(entry, reader)
        yield entry.key, tensor
        del tensor
        reader.maybe_release()


def consolidate(layout: CheckpointLayout, out: str, fmt: str = "safetensors",
                progress: Callable[[int], None] | None = None,
                release_bytes: int = DEFAULT_RELEASE_BYTES) -> list[Entry]:
    """Write the full state dict of ``layout`` to ``out``; refuses a checkpoint with problems.

    ``fmt`` ``safetensors`` streams (memory: about the largest tensor); ``pt`` builds the dict in
    memory first, as ``torch.save`` needs it whole. ``progress(nbytes)`` is called per tensor.
    """
    reader = ShardReader(release_bytes)
    entries = checked_plan(layout, reader)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if fmt == "pt":
        full = {}
        for (key, tensor), entry in zip(iter_tensors(entries, reader), entries):
            full[key] = tensor
            if progress:
                progress(entry.nbytes)
        save_pt(full, out)
        return entries
    writer = StreamWriter(out, [(e.key, e.shape, e.dtype) for e in entries], {"format": "pt"})
    try:
        for (key, tensor), entry in zip(iter_tensors(entries, reader), entries):
            writer.write(key, tensor)
            del tensor  # before the next join: never two full tensors alive at once
            if progress:
                progress(entry.nbytes)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return entries


def save_pt(obj: object, out: str) -> None:
    """``torch.save`` to a temporary sibling, renamed into place (never half a file under ``out``)."""
    tmp = f"{out}.smp2ds-partial"
    torch.save(obj, tmp)
    os.replace(tmp, out)


def problem_text(problems: list[Problem]) -> str:
    lines = [p.text() for p in problems]
    return "the checkpoint is incomplete or inconsistent:\n  " + "\n  ".join(lines)
