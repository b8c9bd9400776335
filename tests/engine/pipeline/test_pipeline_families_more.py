"""RoBERTa heads as pipeline layers on BERT's machinery (one process).

Each head's tiny model (fp32, dropout off) is built from a config; its layer list run in one
process must reproduce the model's own logits, loss and gradients, with padding tokens in
``input_ids`` (RoBERTa's position ids skip them and start at ``padding_idx + 1``) and a padding
mask. The tiny models are shared with ``test_pipeline_hf_decoders_dist.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from smp2ds.engine.pipeline import build_layer_list
from smp2ds.engine.pipeline.families.probe import run_layers
from smp2ds.engine.pipeline.families.roberta import roberta_positions

VOCAB, SEQ, PAD = 64, 8, 1
# kind -> model class
ROBERTA = {"roberta_cls": "RobertaForSequenceClassification", "roberta_mlm": "RobertaForMaskedLM",
           "roberta_qa": "RobertaForQuestionAnswering"}


def make_roberta(kind: str, seed: int = 0, **overrides) -> nn.Module:
    """The head's tiny RoBERTa, identical for the same seed (positions up to SEQ + padding_idx + 1)."""
    import transformers

    fields = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4,
              "num_attention_heads": 2, "max_position_embeddings": SEQ + PAD + 2, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0, "pad_token_id": PAD, "num_labels": 3 if kind == "roberta_cls" else 2,
              **overrides}
    torch.manual_seed(seed)
    return getattr(transformers, ROBERTA[kind])(transformers.RobertaConfig(**fields))


def call(kind: str) -> dict:
    """A padded batch (padding tokens in the ids and in the mask) with the head's labels."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones_like(ids)
    ids[0, 5:], mask[0, 5:] = PAD, 0
    ids[2, 3:], mask[2, 3:] = PAD, 0
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if kind == "roberta_cls":
        kwargs["labels"] = torch.tensor([0, 2, 1])
    elif kind == "roberta_mlm":
        kwargs["labels"] = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    else:  # one span ends beyond the sequence: ignored by the loss
        kwargs["start_positions"], kwargs["end_positions"] = torch.tensor([1, 0, 2]), torch.tensor([4, SEQ + 3, 2])
    return kwargs


CASES = [("roberta_cls", {}), ("roberta_mlm", {}), ("roberta_qa", {}),
         ("roberta_mlm", {"tie_word_embeddings": False}), ("roberta_cls", {"num_labels": 1})]


@pytest.mark.parametrize(("kind", "overrides"), CASES, ids=[f"{k}{'-' + '-'.join(o) if o else ''}" for k, o in CASES])
def test_roberta_layer_list_reproduces_logits_loss_and_gradients(kind, overrides):
    model = make_roberta(kind, **overrides).train()  # dropout is 0
    layer_list = build_layer_list(model)
    assert layer_list.family == ROBERTA[kind]
    kwargs = call(kind)
    if overrides.get("num_labels") == 1:  # regression: float targets, MSE
        kwargs["labels"] = torch.tensor([0.5, -1.0, 2.0])
    ref = model(**kwargs)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out = layer_list.adapter.make_output(run_layers(layer_list, layer_list.adapter.pipe_inputs((), kwargs)), (),
                                         kwargs)
    out.loss.backward()
    for got, want in zip(out.to_tuple(), ref.to_tuple(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    for name, param in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(float(g.abs().max()) > 0 for g in ref_grads.values())


def test_roberta_positions_skip_padding_and_start_after_padding_idx():
    from transformers.models.roberta import modeling_roberta

    ids = torch.tensor([[5, 6, 7, PAD, PAD], [PAD, 9, 9, 9, 9]])
    got = roberta_positions(ids, PAD)
    assert got.tolist() == [[2, 3, 4, 1, 1], [1, 2, 3, 4, 5]]
    # a static method of RobertaEmbeddings on 5.x, a module function on 4.57
    hf = getattr(modeling_roberta.RobertaEmbeddings, "create_position_ids_from_input_ids", None) or \
        modeling_roberta.create_position_ids_from_input_ids
    assert torch.equal(got, hf(ids, PAD))


def test_roberta_layer_names_and_the_tied_decoder():
    from deepspeed.pipe import TiedLayerSpec

    cls = build_layer_list(make_roberta("roberta_cls"))
    assert cls.names == ["roberta.embeddings", *[f"roberta.encoder.layer.{i}" for i in range(4)], "classifier"]
    assert build_layer_list(make_roberta("roberta_qa")).names[-1] == "qa_outputs"
    mlm = build_layer_list(make_roberta("roberta_mlm"))
    assert mlm.names == ["roberta.embeddings.word_embeddings", "roberta.embeddings",
                         *[f"roberta.encoder.layer.{i}" for i in range(4)], "lm_head.dense+layer_norm",
                         "lm_head.decoder", "lm_head.bias"]
    ends = [mlm.layers[0].entry, mlm.layers[-2].entry]
    assert all(isinstance(e, TiedLayerSpec) for e in ends) and ends[0].key == ends[1].key
    untied = build_layer_list(make_roberta("roberta_mlm", tie_word_embeddings=False))
    assert not any(isinstance(layer.entry, TiedLayerSpec) for layer in untied.layers)


def test_explain_splits_a_roberta_config_as_the_engine_does():
    from smp2ds.engine.pipeline import plan_partition
    from smp2ds.engine.pipeline.explain import split_for_model_config

    real = make_roberta("roberta_mlm")
    config = {**real.config.to_dict(), "architectures": ["RobertaForMaskedLM"]}
    split = split_for_model_config(config, {"pipeline_parallel_degree": 2})
    assert split.plan.parts == plan_partition(build_layer_list(real), 2).parts
    assert split.plan.stages[0].layers[0] == "roberta.embeddings.word_embeddings"
