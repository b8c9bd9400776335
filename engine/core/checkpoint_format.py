"""The names in an SMP checkpoint folder, spelled once for the writer, the reader and the resharder.

``smp.save_checkpoint(path, tag, partial=True)`` (SMP 1.10+) and smp2ds's own tools write::

    <path>/
      newest                                   one "<tag>_partial" per line, the last is the newest
      <tag>_partial/
        model_<pp>_<tp>.pt                     each (pipeline stage, tensor-parallel rank)'s model part
        optimizer_states_<pp>_<tp>[_<rdp>].pt  unsharded: rdp rank 0's; sharded: one per rdp rank
        user_content.pt, smp_config.pt         rank 0
        smp2ds_manifest.json                   smp2ds only: files, sizes, digests, layout (written last)
      <tag>, user_content_<tag>                partial=False: the full model state dict (rank 0)

With sharded data parallelism at tensor- and pipeline-parallel degree 1, SMP wrote another layout (the one its
``sharded_data_parallel_checkpoint.py`` helper reads), and smp2ds writes it too::

    <path>/
      newest                                   the newest "<tag>", one line
      <tag>/
        model_0.pt                             {"module": the model's state dict} (rank 0)
        optimizer_<s>.pt                       DeepSpeed's ZeRO-3 state dict of shard rank s, at the top level
        user_content.pt, smp_config.pt, smp2ds_manifest.json

The Hugging Face ``Trainer`` names its SMP parts after its own files, ``smp.save`` appending the rank parts:
``pytorch_model.bin_<pp>_<tp>[.pt]`` and ``optimizer.pt_<pp>_<tp>[_<rdp>][.pt]``.

A partial state dict carries :data:`PARTIAL_MARK` (``True``; ``False`` marks an SMP-named full dict) and
:data:`LOAD_INFO` (the degrees it was saved at). Pure: names only, no I/O.
"""

from __future__ import annotations

import re

SMP2DS_CHECKPOINT_VERSION = "1.15.0"
"""The ``smp_version`` smp2ds writes into a checkpoint's configuration and manifest (the SMP layout it follows)."""

PARTIAL_SUFFIX = "_partial"
NEWEST = "newest"
USER_CONTENT = "user_content.pt"
SMP_CONFIG = "smp_config.pt"
MANIFEST = "smp2ds_manifest.json"
PARTIAL_MARK = "_smp_is_partial"
LOAD_INFO = "_smp_load_info"
ZERO2D_MARK = "_smp_zero2d"
MARKERS = (PARTIAL_MARK, LOAD_INFO, ZERO2D_MARK)
"""The non-tensor entries SMP adds to a model state dict (the last one under sharded data parallelism)."""

MODEL_STEM, OPTIMIZER_STEM = "model", "optimizer_states"
TRAINER_MODEL_STEM, TRAINER_OPTIMIZER_STEM = "pytorch_model.bin", "optimizer.pt"

MODEL_PATTERNS = (re.compile(r"^model_(\d+)_(\d+)\.pt$"), re.compile(r"^pytorch_model\.bin_(\d+)_(\d+)(?:\.pt)?$"))
"""A model part's name (smp.save_checkpoint's, then the Trainer's); groups: pp, tp."""
OPTIMIZER_PATTERNS = (re.compile(r"^optimizer_states_(\d+)_(\d+)(?:_(\d+))?\.pt$"),
                      re.compile(r"^optimizer\.pt_(\d+)_(\d+)(?:_(\d+))?(?:\.pt)?$"))
"""An optimizer part's name (smp.save_checkpoint's, then the Trainer's); groups: pp, tp, rdp or None."""


SDP_MODEL = "model_0.pt"
SDP_MODULE = "module"
SDP_OPTIMIZER_PATTERN = re.compile(r"^optimizer_(\d+)\.pt$")
"""An optimizer part of SMP's sharded-data-parallel layout; group: the shard rank."""


def sdp_optimizer_file(shard_rank: int) -> str:
    """The optimizer part of shard rank ``shard_rank`` in SMP's sharded-data-parallel layout."""
    return f"optimizer_{shard_rank}.pt"


def partial_entry(tag: str) -> str:
    """The folder a partial save of ``tag`` lives in (a tag already naming it is kept)."""
    return tag if tag.endswith(PARTIAL_SUFFIX) else f"{tag}{PARTIAL_SUFFIX}"


def tag_of(entry: str) -> str | None:
    """The tag of a ``<tag>_partial`` folder name; None for any other name."""
    return entry[: -len(PARTIAL_SUFFIX)] if entry.endswith(PARTIAL_SUFFIX) else None


def model_file(pp_rank: int, tp_rank: int, *, trainer: bool = False) -> str:
    """The model part of (``pp_rank``, ``tp_rank``): ``model_<pp>_<tp>.pt`` (the Trainer's: without ``.pt``, the
    suffix ``smp.save`` may add)."""
    return f"{TRAINER_MODEL_STEM}_{pp_rank}_{tp_rank}" if trainer else f"{MODEL_STEM}_{pp_rank}_{tp_rank}.pt"


def optimizer_file(pp_rank: int, tp_rank: int, rdp_rank: int | None = None, *, trainer: bool = False) -> str:
    """The optimizer part of (``pp_rank``, ``tp_rank``), and of ``rdp_rank`` when the state is sharded."""
    suffix = f"_{pp_rank}_{tp_rank}" + (f"_{rdp_rank}" if rdp_rank is not None else "")
    return f"{TRAINER_OPTIMIZER_STEM if trainer else OPTIMIZER_STEM}{suffix}.pt"


def full_user_content(tag: str) -> str:
    """The user content saved beside a full (``partial=False``) checkpoint ``tag``."""
    return f"user_content_{tag}"


def match(name: str, patterns: tuple[re.Pattern[str], ...]) -> tuple[int | None, ...] | None:
    """The rank numbers a part's ``name`` holds under the first of ``patterns`` it matches (absent groups None)."""
    for pattern in patterns:
        found = pattern.match(name)
        if found:
            return tuple(int(g) if g is not None else None for g in found.groups())
    return None
