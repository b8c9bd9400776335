"""``distribute_embedding=True`` of ``smp.nn.DistributedTransformerLMHead`` at tensor_parallel_degree > 1.

The word embedding's rows (the vocabulary) are split over the tensor-parallel group, and so are the
rows of an untied ``lm_head`` and the ``lm_head_bias``: rank ``r`` holds ``V/tp`` of them, so each rank
stores ``1/tp`` of the vocabulary's parameters and computes ``1/tp`` of the logits. Position and
token-type embeddings stay whole (they are small). Every tensor keeps its name and full shape in
``state_dict()`` (shards are joined), so the translators and checkpoints are unchanged.

* lookup: :func:`~smp2ds.engine.nn.parallel.layers.vocab_parallel_lookup` (ids outside a rank's rows
  give zeros; the group sums);
* loss (forward with labels): logits of this rank's vocabulary slice only and the vocab-parallel
  cross-entropy (:mod:`~smp2ds.engine.nn.parallel.cross_entropy`): the full ``[N, S, V]`` logits
  never exist on any rank, and the forward returns ``(loss, None)``;
* without labels the logits are joined over the group (the caller asked for them).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.parallel.collectives import copy_to_tp, gather_last_dim
from smp2ds.engine.nn.parallel.cross_entropy import vocab_parallel_cross_entropy
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.layers import make_vocab_parallel
from smp2ds.engine.nn.parallel.shards import ShardSpec, shard_parameter


def split_vocabulary(model: Any, tp: TPGroup) -> None:
    """Cut the word embedding, an untied head and the head's bias to this rank's vocabulary rows."""
    if model.vocab_size % tp.size:
        raise SMPUnsupportedError(
            f"smp.nn.DistributedTransformerLMHead(distribute_embedding=True): vocab_size {model.vocab_size} is not "
            f"divisible by tensor_parallel_degree {tp.size}; pad the vocabulary to a multiple of {tp.size} (Hugging "
            "Face: model.resize_token_embeddings(n)) or use distribute_embedding=False")
    make_vocab_parallel(model.word_embedding, tp)
    if model.lm_head is not None:
        shard_parameter(model.lm_head, "weight", ShardSpec(0, tp.size), tp.rank)
    if model.lm_head_bias is not None:
        shard_parameter(model, "lm_head_bias", ShardSpec(0, tp.size), tp.rank)


def local_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Logits of this rank's vocabulary slice ``[..., V/tp]`` (the hidden state's gradient is summed over
    the group, as it enters a column-parallel layer)."""
    head = model.word_embedding.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(copy_to_tp(hidden, model.word_embedding._smp2ds_tp), head, model.lm_head_bias)


def full_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """All ``V`` logits (joined over the group)."""
    return gather_last_dim(local_logits(model, hidden), model.word_embedding._smp2ds_tp)


def token_losses(model: Any, hidden: torch.Tensor, labels: torch.Tensor,
                 shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy ``[N, S']`` (zero where the label is -100) and the mask of counted tokens;
    ``shift``: causal models predict token ``t+1`` from position ``t``."""
    logits = local_logits(model, hidden)
    if shift:
        logits, labels = logits[:, :-1, :], labels[:, 1:]
    valid = labels != -100
    losses = vocab_parallel_cross_entropy(logits.float(), labels, model.word_embedding._smp2ds_tp)
    return losses * valid, valid
