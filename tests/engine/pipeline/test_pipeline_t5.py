"""T5 and Flan-T5 (``T5ForConditionalGeneration``) as pipeline layers: encoder stages, then decoder stages
(one process).

Two tiny models (fp32, dropout off) built from configs: the original T5 (ReLU MLP, ``lm_head`` tied to the
shared embedding, decoder output scaled by ``d_model ** -0.5``) and a Flan-T5 / T5 v1.1 one (gated-GELU MLP,
``tie_word_embeddings=False``: no scaling, and an ``lm_head`` of its own; transformers 5.x ties it anyway, so
the test unties it). Their layer lists, run in one process, must reproduce the model's own logits, loss and
gradients, with padding in the attention masks and ignored (-100) labels. The tiny models are shared with
``test_pipeline_t5_dist.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from smp2ds.engine.pipeline import UnsupportedModelError, build_layer_list
from smp2ds.engine.pipeline.families import t5
from smp2ds.engine.pipeline.families.probe import run_layers

VOCAB, SEQ, TARGET = 64, 8, 6
T5_KINDS = {
    "t5": {},
    "flan_t5": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
}


def make_t5(kind: str, seed: int = 0, **overrides) -> nn.Module:
    """The kind's tiny T5, identical for the same seed (3 encoder blocks, 2 decoder blocks)."""
    import transformers

    fields = {"vocab_size": VOCAB, "d_model": 16, "d_kv": 4, "d_ff": 32, "num_layers": 3, "num_decoder_layers": 2,
              "num_heads": 4, "relative_attention_num_buckets": 8, "relative_attention_max_distance": 16,
              "dropout_rate": 0.0, "decoder_start_token_id": 0, "pad_token_id": 0, **T5_KINDS[kind], **overrides}
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**fields))
    if fields.get("tie_word_embeddings") is False and model.lm_head.weight is model.shared.weight:
        g = torch.Generator().manual_seed(seed + 1)  # transformers 5.x always ties lm_head: give it its own weight
        model.lm_head.weight = nn.Parameter(torch.randn(model.lm_head.weight.shape, generator=g) * 0.2)
    return model


def padded_call(decoder_inputs: bool = False) -> dict:
    """A padded batch with labels (one row's tail ignored); or explicit decoder ids with a padded decoder mask."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    labels = torch.randint(1, VOCAB, (3, TARGET), generator=g)
    labels[1, 4:] = -100
    call = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if decoder_inputs:
        call["decoder_input_ids"] = torch.randint(1, VOCAB, (3, TARGET), generator=g)
        call["decoder_attention_mask"] = torch.ones(3, TARGET, dtype=torch.long)
        call["decoder_attention_mask"][0, 4:] = 0
    return call


CASES = [("t5", False), ("flan_t5", False), ("t5", True), ("flan_t5", True)]


@pytest.mark.parametrize(("kind", "decoder_inputs"), CASES,
                         ids=[f"{k}{'-decoder_inputs' if d else ''}" for k, d in CASES])
def test_t5_layer_list_reproduces_logits_loss_and_gradients(kind, decoder_inputs):
    model = make_t5(kind).train()  # dropout is 0: training mode, as the pipeline runs it
    layer_list = build_layer_list(model)
    assert layer_list.family == "T5ForConditionalGeneration"
    call = padded_call(decoder_inputs)
    ref = model(**call)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = layer_list.adapter.make_output(run_layers(layer_list, layer_list.adapter.pipe_inputs((), call)), (), call)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    rel = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    assert float(ref_grads[rel].abs().max()) > 0  # the bias layers' gradient reaches the embedding


def test_layers_ties_and_held_parameters():
    from deepspeed.pipe import TiedLayerSpec

    for kind, head_tied in (("t5", True), ("flan_t5", False)):
        model = make_t5(kind)
        layer_list = build_layer_list(model)
        blocks = [name for i in range(3) for name in (f"encoder.block.{i}.position_bias", f"encoder.block.{i}")]
        dec = [name for i in range(2) for name in (f"decoder.block.{i}.position_bias", f"decoder.block.{i}")]
        assert layer_list.names == ["encoder.embed_tokens", "encoder.dropout", *blocks, "encoder.final_layer_norm",
                                    "decoder.embed_tokens", "decoder.dropout", *dec, "decoder.final_layer_norm",
                                    "lm_head"]
        keys = {layer.name: layer.entry.key for layer in layer_list.layers if isinstance(layer.entry, TiedLayerSpec)}
        shared = ["encoder.embed_tokens", "decoder.embed_tokens"] + (["lm_head"] if head_tied else [])
        assert sorted(n for n, k in keys.items() if k == "t5_shared") == sorted(shared), kind
        assert sorted(n for n, k in keys.items() if k == "t5_encoder_relative_attention_bias") == blocks[::2]
        assert sorted(n for n, k in keys.items() if k == "t5_decoder_relative_attention_bias") == dec[::2]
        # every parameter is held by a layer; the first block holds all of its own but the relative bias
        held = {id(p) for layer in layer_list.layers for m in layer.modules for p in m.parameters()}
        assert held == {id(p) for p in model.parameters()}
        first = layer_list.layers[layer_list.names.index("encoder.block.0")].entry
        rel = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias
        assert all(p is not rel.weight for p in first.parameters())
        assert len(list(first.parameters())) == len(list(model.encoder.block[0].parameters())) - 1
        # the original T5 scales the decoder output before the tied head, Flan-T5 does not
        norm = layer_list.layers[layer_list.names.index("decoder.final_layer_norm")].entry
        assert norm.scale == (16 ** -0.5 if kind == "t5" else None)


def test_first_block_follows_train_and_eval_through_its_unregistered_attention():
    model = make_t5("t5").train()
    first = build_layer_list(model).layers[3].entry
    first.eval()
    assert not model.encoder.block[0].layer[0].SelfAttention.training
    first.train()
    assert model.encoder.block[0].layer[0].SelfAttention.training


def test_calls_the_pipeline_cannot_honour_are_refused_by_name():
    model = make_t5("t5")
    adapter = build_layer_list(model).adapter
    ids = torch.ones(2, SEQ, dtype=torch.long)
    with pytest.raises(UnsupportedModelError, match="needs labels or decoder_input_ids"):
        adapter.pipe_inputs((), {"input_ids": ids})
    with pytest.raises(UnsupportedModelError, match=r"does not support the argument\(s\) \['inputs_embeds'\]"):
        adapter.pipe_inputs((), {"input_ids": ids, "labels": ids, "inputs_embeds": torch.zeros(2, SEQ, 16)})
    # labels shift right into the decoder input, as the model's own _shift_right (start token, -100 -> pad)
    labels = torch.tensor([[5, 6, -100, -100]])
    assert adapter.pipe_inputs((), {"input_ids": ids[:1], "labels": labels})[2].tolist() == [[0, 5, 6, 0]]


def test_a_layer_list_that_does_not_reproduce_the_forward_is_refused():
    model = make_t5("t5")
    built = t5.layer_list(model)
    built.layers[-2].entry.scale = 1.0  # drop the original T5's decoder-output scaling
    with pytest.raises(UnsupportedModelError, match="T5 layer list's logits differ from its forward's"):
        t5.check_equivalent(model, built)


def test_explain_splits_a_t5_config_without_weights():
    from smp2ds.engine.pipeline.explain import split_for_model_config

    config = {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 32, "d_ff": 64,
              "num_layers": 4, "num_heads": 4, "vocab_size": 128, "tie_word_embeddings": False}
    split = split_for_model_config(config, {"pipeline_parallel_degree": 2})
    assert split.architecture == "T5ForConditionalGeneration"
    assert [s.layers[0] for s in split.plan.stages][0] == "encoder.embed_tokens"
    assert split.plan.stages[-1].layers[-1] == "lm_head"
