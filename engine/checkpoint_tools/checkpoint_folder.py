"""What a checkpoint folder holds, read from its file names, its manifest and ``smp_config.pt``.

Folders understood (every name as SMP wrote it; smp2ds writes the same):

* a ``save_checkpoint`` root: ``newest`` and one ``<tag>_partial/`` per save (the newest is read
  unless a tag is chosen);
* one ``<tag>_partial/``: ``model_<pp>_<tp>.pt``, ``optimizer_states_<pp>_<tp>[_<rdp>].pt``,
  ``user_content.pt``, ``smp_config.pt`` and, when smp2ds wrote it, ``smp2ds_manifest.json``;
* SMP's sharded-data-parallel layout (tensor- and pipeline-parallel degree 1): ``newest`` naming ``<tag>``, and
  ``<tag>/`` with ``model_0.pt`` (the state under ``module``), ``optimizer_<s>.pt`` per shard rank and
  ``user_content.pt`` (:mod:`.sdp_layout`), as SMP and smp2ds write it;
* a Hugging Face Trainer checkpoint of an SMP run: ``pytorch_model.bin_<pp>_<tp>[.pt]``,
  ``optimizer.pt_<pp>_<tp>[_<rdp>][.pt]``, ``user_content.pt``, ``scheduler.pt``.

Nothing here unpickles a model or optimizer file; :func:`find` only names files and checks what
the names and the manifest promise. Problems are collected, each naming its file, rather than
raised: ``inspect`` reports all of them at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from smp2ds.engine.checkpoint_tools import sdp_layout
from smp2ds.engine.checkpoint_tools.reading import load_weights
from smp2ds.engine.core import checkpoint_commit as commit
from smp2ds.engine.core import checkpoint_format as fmt
from smp2ds.engine.core import sdp_checkpoint
from smp2ds.engine.exceptions import SMPCheckpointError


@dataclass(frozen=True)
class Problem:
    """Something missing or wrong, and the file it concerns."""

    file: str
    message: str

    def text(self) -> str:
        return f"{self.file}: {self.message}"


@dataclass
class CheckpointLayout:
    """The files of one partial checkpoint and the layout they were saved with."""

    directory: str
    kind: str
    tag: str | None
    newest: list[str]
    model_files: dict[tuple[int, int], str]
    optimizer_files: dict[tuple[int, int, int | None], str]
    pp: int
    tp: int
    rdp: int | None
    sdp: int
    config: dict[str, Any]
    manifest: dict[str, Any] | None
    extras: dict[str, str] = field(default_factory=dict)
    """``user_content`` / ``scheduler`` / ``smp_config`` / ``trainer_state`` -> file, those present."""
    problems: list[Problem] = field(default_factory=list)
    smp_sdp: bool = False
    """SMP's sharded-data-parallel layout: one model file, ``sdp`` optimizer files (the first shard group's)."""
    param_groups: list[dict[str, Any]] | None = None
    """The user content's ``param_shapes`` (per optimizer group, name -> shape) in that layout, when saved."""

    @property
    def optimizer_sharded(self) -> bool:
        return any(key[2] is not None for key in self.optimizer_files)

    def stage_files(self, stage: int) -> list[str]:
        """The model files of pipeline stage ``stage``, by tensor-parallel rank."""
        return [self.model_files[(stage, t)] for t in range(self.tp) if (stage, t) in self.model_files]


def _entry_dir(path: str, tag: str | None) -> tuple[str, str | None, list[str]]:
    """(partial directory, its tag, the ``newest`` entries) for a root folder or a partial folder."""
    marker = os.path.join(path, fmt.NEWEST)
    newest: list[str] = []
    if os.path.isfile(marker):
        with open(marker) as handle:
            newest = [ln.strip() for ln in handle if ln.strip()]
    partial_dirs = sorted(d for d in os.listdir(path) if fmt.tag_of(d) is not None and os.path.isdir(
        os.path.join(path, d)))
    sdp_dirs = sorted(d for d in os.listdir(path) if sdp_checkpoint.is_sdp_dir(os.path.join(path, d)))
    if tag is not None:
        entry = fmt.partial_entry(tag)
        if tag in sdp_dirs and not os.path.isdir(os.path.join(path, entry)):
            return os.path.join(path, tag), tag, newest
        if not (newest or partial_dirs):
            raise SMPCheckpointError(f"{path}: --tag {tag!r} given, but this folder holds no <tag>_partial folders "
                                     "(it is a checkpoint itself; leave --tag out)")
        try:
            return commit.resolve_dir(path, entry), fmt.tag_of(entry), newest
        except SMPCheckpointError:
            raise SMPCheckpointError(f"{os.path.join(path, entry)}: no checkpoint with tag {tag!r}; this folder "
                                     f"holds {', '.join(partial_dirs) or 'none'}") from None
    if newest:
        entry = newest[-1]
        if not os.path.isdir(os.path.join(path, entry)):
            raise SMPCheckpointError(f"{marker}: names {entry!r} as the newest checkpoint, but "
                                     f"{os.path.join(path, entry)} does not exist")
        return os.path.join(path, entry), _tag(entry), newest
    saves = partial_dirs + sdp_dirs
    if len(saves) == 1:
        return os.path.join(path, saves[0]), _tag(saves[0]), newest
    if len(saves) > 1:
        raise SMPCheckpointError(f"{path}: holds several checkpoints ({', '.join(saves)}) and no newest "
                                 "file; choose one with --tag")
    name = os.path.basename(os.path.normpath(path))
    return path, _tag(name) if sdp_checkpoint.is_sdp_dir(path) else fmt.tag_of(name), newest


def _tag(entry: str) -> str | None:
    """The tag of a save's folder: ``<tag>_partial``, or SMP's sharded-data-parallel ``<tag>``."""
    return fmt.tag_of(entry) if entry.endswith(fmt.PARTIAL_SUFFIX) else entry


def _config(path: str, problems: list[Problem]) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        cfg = load_weights(path, mmap=False)
    except SMPCheckpointError as exc:
        problems.append(Problem(path, str(exc).split(": ", 1)[-1]))
        return {}
    return cfg if isinstance(cfg, dict) else {}


def find(path: str, tag: str | None = None) -> CheckpointLayout:
    """Read the layout of the checkpoint at ``path`` (see the module docstring for the folders)."""
    if not os.path.exists(path):
        raise SMPCheckpointError(f"{path}: no such file or folder")
    if not os.path.isdir(path):
        raise SMPCheckpointError(f"{path}: is a file; smp2ds checkpoint reads a checkpoint folder (the path given "
                                 "to smp.save_checkpoint, one <tag>_partial folder, or a Trainer checkpoint-N folder)")
    directory, found_tag, newest = _entry_dir(path, tag)
    if sdp_checkpoint.is_sdp_dir(directory):
        return _find_sdp(directory, found_tag, newest)
    problems: list[Problem] = []
    models: dict[tuple[int, int], str] = {}
    optimizers: dict[tuple[int, int, int | None], str] = {}
    names = sorted(os.listdir(directory))
    for name in names:
        full = os.path.join(directory, name)
        if (m := fmt.match(name, fmt.MODEL_PATTERNS)) is not None:
            models[(int(m[0] or 0), int(m[1] or 0))] = full
        elif (o := fmt.match(name, fmt.OPTIMIZER_PATTERNS)) is not None:
            optimizers[(o[0], o[1], o[2])] = full
    if not models:
        raise SMPCheckpointError(f"{directory}: no partial model files (model_<pp>_<tp>.pt or "
                                 "pytorch_model.bin_<pp>_<tp>) in this folder; it is not a partial SMP checkpoint")
    extras = {k: os.path.join(directory, f) for k, f in (
        ("user_content", fmt.USER_CONTENT), ("smp_config", fmt.SMP_CONFIG), ("scheduler", "scheduler.pt"),
        ("trainer_state", "trainer_state.json")) if os.path.isfile(os.path.join(directory, f))}
    try:
        manifest = commit.read_manifest(directory)
    except SMPCheckpointError as exc:
        problems.append(Problem(os.path.join(directory, fmt.MANIFEST), str(exc).split(": ", 1)[-1]))
        manifest = None
    config = _config(extras.get("smp_config", ""), problems)
    kind = "smp2ds partial checkpoint" if manifest else (
        "Hugging Face Trainer checkpoint (SMP)" if any(fmt.TRAINER_MODEL_STEM in f for f in models.values())
        else "SMP partial checkpoint")
    saved = (manifest or {}).get("layout", {})
    pp = int(saved.get("pipeline_parallel_degree") or config.get("pipeline_parallel_degree") or
             max(k[0] for k in models) + 1)
    tp = int(saved.get("tensor_parallel_degree") or config.get("tensor_parallel_degree") or
             max(k[1] for k in models) + 1)
    rdp = saved.get("rdp")
    if rdp is None and any(k[2] is not None for k in optimizers):
        rdp = max(k[2] or 0 for k in optimizers) + 1
    sdp = int(config.get("sharded_data_parallel_degree") or 1)
    if tag is None and found_tag is None and "trainer_state" in extras:
        found_tag = _trainer_step(extras["trainer_state"])
    layout = CheckpointLayout(directory, kind, found_tag, newest, models, optimizers, pp, tp,
                              int(rdp) if rdp is not None else None, sdp, config, manifest, extras, problems)
    _check_completeness(layout)
    if manifest is not None:
        _check_manifest(layout)
    return layout


def _find_sdp(directory: str, tag: str | None, newest: list[str]) -> CheckpointLayout:
    """SMP's sharded-data-parallel layout: ``model_0.pt`` and the first shard group's ``optimizer_<s>.pt``."""
    problems: list[Problem] = []
    extras = {k: os.path.join(directory, f) for k, f in (("user_content", fmt.USER_CONTENT),
                                                          ("smp_config", fmt.SMP_CONFIG))
              if os.path.isfile(os.path.join(directory, f))}
    try:
        manifest = commit.read_manifest(directory)
    except SMPCheckpointError as exc:
        problems.append(Problem(os.path.join(directory, fmt.MANIFEST), str(exc).split(": ", 1)[-1]))
        manifest = None
    config = _config(extras.get("smp_config", ""), problems)
    shards = sdp_layout.optimizer_files(directory)
    saved = (manifest or {}).get("layout", {})
    sdp = int(config.get("sharded_data_parallel_degree") or saved.get("sharded_data_parallel_degree")
              or _partition_count(shards, problems) or 1)
    try:
        groups = sdp_layout.parameter_groups(directory)
    except SMPCheckpointError as exc:
        problems.append(Problem(extras.get("user_content", directory), str(exc).split(": ", 1)[-1]))
        groups = None
    kind = "SMP sharded-data-parallel checkpoint" + (" (written by smp2ds)" if manifest else "")
    layout = CheckpointLayout(directory, kind, tag, newest, {(0, 0): os.path.join(directory, fmt.SDP_MODEL)},
                              {(0, 0, s): f for s, f in shards.items()}, 1, 1, int(saved.get("rdp") or sdp), sdp,
                              config, manifest, extras, problems, smp_sdp=True, param_groups=groups)
    for s in range(sdp):
        if shards and s not in shards:
            problems.append(Problem(os.path.join(directory, fmt.sdp_optimizer_file(s)),
                                    f"missing: optimizer state of shard rank {s} "
                                    f"(sharded_data_parallel_degree {sdp})"))
    for s, file in sorted(shards.items()):
        if s >= sdp:
            problems.append(Problem(file, f"shard rank {s} does not fit sharded_data_parallel_degree {sdp} (a file "
                                    "of another save?)"))
    if manifest is not None:
        _check_manifest(layout)
    return layout


def _partition_count(shards: dict[int, str], problems: list[Problem]) -> int | None:
    """Over how many ranks the first optimizer file says its state is partitioned (SMP wrote no configuration)."""
    if not shards:
        return None
    first = shards[min(shards)]
    try:
        obj = load_weights(first, deepspeed_state=True)
    except SMPCheckpointError as exc:
        problems.append(Problem(first, str(exc).split(": ", 1)[-1]))
        return len(shards)
    return sdp_checkpoint.partition_count(obj) if isinstance(obj, dict) else len(shards)


def _trainer_step(path: str) -> str | None:
    try:
        with open(path) as handle:
            step = json.load(handle).get("global_step")
    except (OSError, ValueError, AttributeError):
        return None
    return f"step {step}" if step is not None else None


def _check_completeness(layout: CheckpointLayout) -> None:
    """Every (stage, tp rank) model file present, none beyond the degrees; optimizer files likewise."""
    d, problems = layout.directory, layout.problems
    trainer = "Trainer" in layout.kind
    for stage in range(layout.pp):
        for rank in range(layout.tp):
            if (stage, rank) not in layout.model_files:
                problems.append(Problem(os.path.join(d, fmt.model_file(stage, rank, trainer=trainer)),
                                        f"missing: the model part of pipeline stage {stage}, tensor-parallel rank "
                                        f"{rank} (pp {layout.pp} x tp {layout.tp} needs every one)"))
    for (stage, rank), file in sorted(layout.model_files.items()):
        if stage >= layout.pp or rank >= layout.tp:
            problems.append(Problem(file, f"a part of stage {stage}, tp rank {rank} does not fit the saved layout "
                                    f"pp {layout.pp} x tp {layout.tp} (a file of another save?)"))
    if not layout.optimizer_files:
        return
    sharded = {k for k in layout.optimizer_files if k[2] is not None}
    if sharded and len(sharded) != len(layout.optimizer_files):
        problems.append(Problem(d, "optimizer files mix the sharded (_<pp>_<tp>_<rdp>) and unsharded "
                                "(_<pp>_<tp>) naming: files of two saves?"))
    expected = [(s, t, r) for s in range(layout.pp) for t in range(layout.tp)
                for r in (range(layout.rdp or 1) if sharded else (None,))]
    for key in expected:
        if key not in layout.optimizer_files:
            name = fmt.optimizer_file(key[0], key[1], key[2], trainer=trainer)  # the name smp.save gives it
            problems.append(Problem(os.path.join(d, name),
                                    "missing: optimizer state of pipeline stage {}, tp rank {}{}".format(
                                        key[0], key[1], f", rdp rank {key[2]}" if key[2] is not None else "")))


def _check_manifest(layout: CheckpointLayout) -> None:
    """Sizes and SHA-256 digests against the manifest smp2ds wrote last; files it does not list."""
    manifest, d = layout.manifest or {}, layout.directory
    listed = manifest.get("files", {})
    if layout.tag is not None and manifest.get("tag") not in (None, layout.tag):
        layout.problems.append(Problem(os.path.join(d, fmt.MANIFEST), f"the manifest is of tag "
                                       f"{manifest.get('tag')!r} but the folder is named for tag {layout.tag!r}"))
    for name, record in sorted(listed.items()):
        file = os.path.join(d, name)
        if not os.path.isfile(file):
            layout.problems.append(Problem(file, "missing although the manifest lists it"))
            continue
        size = os.path.getsize(file)
        if size != record.get("size"):
            layout.problems.append(Problem(file, f"{size} bytes, but the manifest recorded {record.get('size')}: "
                                           "truncated or replaced after the save"))
        elif commit.file_digest(file) != record.get("sha256"):
            layout.problems.append(Problem(file, "its SHA-256 differs from the manifest's: this file was written by "
                                           "another save (tags mixed) or changed afterwards"))
    ours = set(layout.model_files.values()) | set(layout.optimizer_files.values())
    for file in sorted(ours):
        if os.path.basename(file) not in listed:
            layout.problems.append(Problem(file, "not listed in the manifest: a file of another save (tags mixed)"))
