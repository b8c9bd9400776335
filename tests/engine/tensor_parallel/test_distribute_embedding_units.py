"""``distribute_embedding`` without other ranks: accepted by ``DistributedTransformerLMHead`` (at tp 1 there is
nothing to split: the same model), refused by the modules that own no embedding."""

from __future__ import annotations

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smp2ds.engine.exceptions import SMPUnsupportedError

SIZES = {"num_layers": 1, "num_attention_heads": 2, "attention_head_size": 4, "hidden_size": 8,
         "intermediate_size": 16, "vocab_size": 12, "num_positions": 8, "causal_mask_size": 8,
         "attention_dropout_prob": 0.0, "hidden_dropout_prob": 0.0, "embedding_dropout_prob": 0.0}


def test_lm_head_accepts_distribute_embedding_and_at_tp1_is_the_same_model():
    torch.manual_seed(0)
    plain = smp.nn.DistributedTransformerLMHead(**SIZES)
    torch.manual_seed(0)
    split = smp.nn.DistributedTransformerLMHead(**SIZES, distribute_embedding=True)
    assert split.vocab_parallel is False  # tp 1: nothing to split
    ids = torch.randint(0, 12, (2, 6), generator=torch.Generator().manual_seed(1))
    loss_a, logits_a = plain((ids, None, None, None, ids))
    loss_b, logits_b = split((ids, None, None, None, ids))
    assert torch.equal(logits_a, logits_b) and torch.equal(loss_a, loss_b)


@pytest.mark.parametrize("cls", ["DistributedTransformer", "DistributedTransformerLayer"])
def test_modules_without_an_embedding_refuse_distribute_embedding(cls):
    sizes = {k: SIZES[k] for k in ("num_attention_heads", "attention_head_size", "hidden_size", "intermediate_size")}
    with pytest.raises(SMPUnsupportedError, match=r"distribute_embedding=True\): a vocab-parallel embedding outside "
                                                  "DistributedTransformerLMHead"):
        getattr(smp.nn, cls)(**sizes, distribute_embedding=True)

