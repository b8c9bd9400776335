"""BERT / RoBERTa encoders replaced by ``smp.nn.DistributedTransformer`` at tensor_parallel_degree 1 (no
processes): the translators' exact round trip, logits / loss / gradients equal to Hugging Face's for the
same weights (eager and sdpa masks), and an SMP state dict loading into the Hugging Face model."""

from __future__ import annotations

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface import bert as bert_tr
from smp2ds.engine.nn.huggingface import roberta as roberta_tr
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked
from tests.engine.hf_equivalence import assert_same_logits_loss_and_gradients, assert_same_state

VOCAB = 40


def hf_model(family: str, seed: int, attn: str = "eager", **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    cfg_cls, cls = (tf.BertConfig, tf.BertForMaskedLM) if family == "bert" else \
        (tf.RobertaConfig, tf.RobertaForMaskedLM)
    cfg = cfg_cls(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=4, vocab_size=VOCAB,
                  max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **overrides)
    cfg._attn_implementation = attn
    return cls(cfg)


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


@pytest.mark.parametrize(("family", "translator"), [("bert", bert_tr), ("roberta", roberta_tr)])
def test_encoder_translators_round_trip_exactly(family, translator):
    to_smp = getattr(translator, f"translate_hf_state_dict_to_smdistributed_{family}")
    to_hf = getattr(translator, f"translate_state_dict_to_hf_{family}")
    sd = hf_model(family, 0).state_dict()
    smp_sd = to_smp(sd)
    assert f"{family}.encoder.seq_layers.1.attention.query.weight" in smp_sd
    assert f"{family}.encoder.seq_layers.0.output.dense2.weight" in smp_sd
    assert f"{family}.embeddings.word_embeddings.weight" in smp_sd  # outside the encoder: unchanged
    back = to_hf(smp_sd)
    assert_same_state(back, sd)
    again = to_smp(back)
    assert_same_state(again, smp_sd)
    with pytest.raises(KeyError, match=f"'{family}.encoder.layer.0.odd.weight' is not an encoder-layer parameter"):
        to_smp({f"{family}.encoder.layer.0.odd.weight": torch.zeros(1)})


@pytest.mark.parametrize(("family", "attn"), [("bert", "eager"), ("bert", "sdpa"), ("roberta", "eager")])
def test_replaced_encoder_gives_hf_logits_loss_and_gradients(family, attn):
    translate = getattr(bert_tr if family == "bert" else roberta_tr, f"translate_hf_state_dict_to_smdistributed_{family}")
    with marks.tensor_parallelism(fused_softmax=True):
        net = hf_model(family, 4, attn)
    ref = hf_model(family, 4, attn)
    new = replace_marked(net, ParallelContext())
    assert new is net
    encoder = getattr(net, family).encoder
    assert isinstance(encoder, smp.nn.DistributedTransformer) and encoder.config is net.config
    assert [type(c).__name__ for c in encoder.seq_layers.children()] == ["DistributedTransformerLayer"] * 2
    assert all(not (marks.mark_of(m) or marks.Mark(False)).enabled for m in net.modules())  # rest kept whole
    ids, mask = batch()
    assert_same_logits_loss_and_gradients(net, ref, ids, mask, translate)


def test_smp_bert_state_dict_loads_into_hf_with_the_same_logits():
    with marks.tensor_parallelism(fused_softmax=True):
        net = replace_marked(hf_model("bert", 5), ParallelContext())
    net.eval()
    hf = hf_model("bert", 6).eval()
    hf.load_state_dict(bert_tr.translate_state_dict_to_hf_bert(net.state_dict()), strict=True)
    ids, mask = batch(8)
    keep = mask.bool()
    assert torch.allclose(hf(input_ids=ids, attention_mask=mask).logits[keep],
                          net(input_ids=ids, attention_mask=mask).logits[keep], atol=1e-5, rtol=0)


def test_bert_decoder_is_refused():
    with marks.tensor_parallelism(fused_softmax=True):
        net = hf_model("bert", 0, is_decoder=True)
    with pytest.raises(SMPUnsupportedError, match="a BERT/RoBERTa decoder .* cannot be replaced"):
        replace_marked(net, ParallelContext())
