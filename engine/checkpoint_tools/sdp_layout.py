"""SMP's sharded-data-parallel checkpoint layout read offline (``<tag>/model_0.pt``, ``optimizer_<s>.pt``).

The layout (:mod:`smp2ds.engine.core.sdp_checkpoint`) stores each shard rank's ZeRO-3 state once, for the first
shard group. Two facts are not in the files themselves and come from the user content, where SMP's GPT-2
example puts them for its ``sharded_data_parallel_checkpoint.py`` helper:

* ``param_shapes``: per optimizer parameter group, parameter name -> full shape, in the order of the flat
  partitions. With it, optimizer state of several parameter groups (weight decay split) is matched to its
  parameters, and a model file that holds SMP's empty placeholders gets its weights from the master copies.
* ``buffer_names``: which of ``module``'s tensors are buffers (informational here: buffers are stored whole).

The weights are rebuilt the way SMP's helper documents it: each shard's flat groups joined, then for every
parameter in ``param_shapes`` order ``ceil(numel / S)`` elements from each shard rank, joined and cut to
``numel``. Names may carry SMP's ``module.`` prefix; it is dropped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch

from smp2ds.engine.checkpoint_tools import zero_partitions
from smp2ds.engine.core import checkpoint_format as fmt
from smp2ds.engine.core import safe_load
from smp2ds.engine.exceptions import SMPCheckpointError

SMP_PREFIX = "module."
_EMBEDDINGS = ("wte.weight", "embed_tokens.weight", "word_embeddings.weight", "word_embedding.weight")
"""Input embeddings a tied output head shares (SMP's ``param_shapes`` names the shared parameter once)."""
_TIED_HEADS = ("lm_head.weight", "predictions.decoder.weight")


def optimizer_files(directory: str) -> dict[int, str]:
    """``{shard rank: optimizer_<s>.pt}`` of one folder."""
    out = {}
    for name in os.listdir(directory):
        found = fmt.SDP_OPTIMIZER_PATTERN.match(name)
        if found:
            out[int(found.group(1))] = os.path.join(directory, name)
    return out


def strip_prefix(name: str) -> str:
    return name[len(SMP_PREFIX):] if name.startswith(SMP_PREFIX) else name


def parameter_groups(directory: str) -> list[dict[str, torch.Size]] | None:
    """The user content's ``param_shapes`` (per group, name -> shape, ``module.`` dropped), or None when the folder
    has no user content or it holds no ``param_shapes``. Read without running code from the file."""
    path = os.path.join(directory, fmt.USER_CONTENT)
    if not os.path.isfile(path):
        return None
    content = safe_load.load(path, user_content=True)
    shapes = content.get("param_shapes") if isinstance(content, Mapping) else None
    if shapes is None:
        return None
    if isinstance(shapes, Mapping):
        shapes = [shapes]
    if not isinstance(shapes, (list, tuple)) or not all(isinstance(g, Mapping) for g in shapes):
        raise SMPCheckpointError(f"{path}: param_shapes is a {type(shapes).__name__}; SMP's scripts save a list of "
                                 "dicts (one per optimizer parameter group) of parameter name -> shape")
    return [{strip_prefix(str(n)): torch.Size(s) for n, s in group.items()} for group in shapes]


def master_weights(directory: str) -> dict[str, torch.Tensor]:
    """Every parameter of ``param_shapes`` rebuilt from the shard ranks' fp32 master partitions."""
    groups = parameter_groups(directory)
    if groups is None:
        raise SMPCheckpointError(
            f"{os.path.join(directory, fmt.SDP_MODEL)}: holds the parameters only as empty placeholders, and "
            f"{fmt.USER_CONTENT} has no param_shapes saying which slice of the flat partitions each one is; save "
            "user_content['param_shapes'] as SMP's GPT-2 example does (its get_param_shapes(model, optimizer))")
    files = optimizer_files(directory)
    count = len(files)
    missing = [s for s in range(count) if s not in files]
    if missing:
        raise SMPCheckpointError(f"{directory}: optimizer_<s>.pt of shard rank(s) {missing} missing")
    flats = [torch.cat([t.reshape(-1).float() for t in zero_partitions.read(files[s], count, grouped=True)
                        [zero_partitions.MASTER]]) for s in range(count)]
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in ((n, s) for group in groups for n, s in group.items()):
        numel = math.prod(shape)
        size = zero_partitions.shard_size(numel, count)
        out[name] = torch.cat([flat[offset:offset + size] for flat in flats])[:numel].reshape(shape).clone()
        offset += size
    if offset != flats[0].numel():
        raise SMPCheckpointError(
            f"{directory}: param_shapes accounts for {offset} of the {flats[0].numel()} elements of each shard's "
            "flat partitions: the user content belongs to another model or optimizer")
    return out


def fill_placeholders(directory: str, module: dict[str, torch.Tensor], placeholders: list[str]) -> None:
    """Replace ``module``'s empty placeholders by the master weights, in place (a tied head takes the input
    embedding it shares); a placeholder neither covers is refused by name."""
    masters = master_weights(directory)
    for key in placeholders:
        name = strip_prefix(key)
        if name in masters:
            module[key] = masters[name]
            continue
        shared = [n for n in masters if n.endswith(_EMBEDDINGS)]
        if name.endswith(_TIED_HEADS) and len(shared) == 1:
            module[key] = masters[shared[0]]
            continue
        raise SMPCheckpointError(f"{os.path.join(directory, fmt.SDP_MODEL)}: {key} is an empty placeholder that "
                                 f"param_shapes in {fmt.USER_CONTENT} does not name: its value is not in the files")
