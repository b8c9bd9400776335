"""SMP's ``optimize: memory`` at tensor_parallel_degree 2 on 2 real ranks (gloo, DeepSpeed): the
distributed transformer splits the sequence between sublayers (sequence parallelism).

* Hugging Face GPT-2 (with activation checkpointing of ``.attention`` / ``.output``), BERT, GPT-NeoX and
  GPT-J built inside ``smp.model_creation(tensor_parallelism=True, ...)`` and replaced by SMP's
  distributed transformer train equal to single-process Hugging Face training (losses and weights);
* the activations one layer saves for backward, counted with ``saved_tensors_hooks``: the tensors shaped
  like the hidden states shrink by at least the degree, the head- and feature-split ones are unchanged;
* a sequence length not divisible by the degree is refused, naming both;
* dropout on split tokens: each rank draws its own masks, reproduced from the same stream state;
* with pipeline stages (tp 2 x pp 2, each ``seq_layers`` layer a stage layer that splits and joins the
  sequence itself) GPT-2 trains equal to single-process Hugging Face training with micro-batches.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from smp2ds.engine.diagnostics.saved_activations import split_bytes
from tests._dist import run_ranks
from tests.engine.workers import sequence_parallel_workers as sw
from tests.engine.workers import transformer_workers as tw

B, TP = 3, 2
BASE = {"ddp": True, "tensor_parallel_degree": TP, "tensor_parallel_seed": 3}
PHASES = [
    {"optimizer": "sgd", "seed": 2, "steps": 2, "activation_checkpointing": True},
    {"optimizer": "adamw", "seed": 4, "steps": 2, "family": "bert"},
    {"optimizer": "sgd", "seed": 8, "steps": 2, "family": "neox"},
    {"optimizer": "adamw", "seed": 9, "steps": 2, "family": "gptj", "activation_checkpointing": True},
    {"optimizer": "sgd", "seed": 7, "steps": 2, "dropout": 0.2},
]


@pytest.fixture(scope="module")
def runs() -> dict:
    return {"memory": run_ranks(sw.run, TP, {**BASE, "optimize": "memory"}, PHASES, B),
            "speed": run_ranks(sw.run, TP, {**BASE, "optimize": "speed"}, [], B)}


@pytest.mark.slow
def test_memory_layout_trains_like_single_process_hugging_face(runs):
    per_rank = runs["memory"]
    assert [r["optimize"] for r in per_rank] == ["memory"] * TP
    for p, phase in enumerate(PHASES):
        if phase.get("dropout"):
            continue
        ref = tw.reference(phase, per_rank[0]["phases"][p]["data_ranks"], B)
        for rank in range(TP):
            got = per_rank[rank]["phases"][p]
            r = got["data_rank"]
            np.testing.assert_allclose(got["losses"], [step[r] for step in ref["losses"]], rtol=1e-4, atol=1e-6)
            assert set(got["weights"]) == set(ref["weights"])
            for key, want in ref["weights"].items():
                np.testing.assert_allclose(got["weights"][key], want.numpy(), rtol=1e-4, atol=1e-5,
                                           err_msg=f"{phase.get('family', 'gpt2')} {key}")


@pytest.mark.slow
def test_memory_layout_equals_speed_layout_for_a_split_vocabulary_and_fp32_residuals(runs):
    """``smp.nn.DistributedTransformerLMHead`` used directly: vocab-parallel loss (pre-layernorm), and
    post-layernorm with token types, an LM-head bias and an fp32 residual stream."""
    for mem, speed in zip(runs["memory"], runs["speed"]):
        assert set(mem["direct"]) == set(sw.DIRECT)
        for name, got in mem["direct"].items():
            want = speed["direct"][name]
            np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5, err_msg=name)
            assert set(got["grads"]) == set(want["grads"])
            for key, grad in want["grads"].items():
                assert np.abs(grad).sum() > 0, f"{name} {key}"
                np.testing.assert_allclose(got["grads"][key], grad, rtol=1e-4, atol=1e-6, err_msg=f"{name} {key}")


@pytest.mark.slow
def test_memory_layout_with_dropout_keeps_replicated_parameters_equal(runs):
    """Each rank's layer norms see only its tokens: their gradients are summed over the group, so the
    replicas stay equal while training with dropout moves them."""
    p = next(i for i, phase in enumerate(PHASES) if phase.get("dropout"))
    a, b = (r["phases"][p]["local"] for r in runs["memory"])
    norms = [k for k in a if "layernorm" in k]
    assert len(norms) == 2 * 2 * 2 + 2  # weight and bias of two norms per layer, and of the final norm
    for key in norms:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    initial = tw.hf_of(PHASES[p]).state_dict()
    assert not np.allclose(a["transformer.seq_layers.0.attention.layernorm.weight"], initial["transformer.h.0.ln_1.weight"])


@pytest.mark.slow
def test_memory_layout_saves_fewer_activations_per_layer(runs):
    h = sw.LAYER["hidden_size"]
    assert h not in (sw.LAYER["attention_head_size"], sw.LAYER["intermediate_size"] // TP, 16, 1)
    mem, speed = runs["memory"][0], runs["speed"][0]
    for key in ("one_layer", "two_layers"):
        assert mem[key]["out_shape"] == speed[key]["out_shape"] == (2, 16, h)
    per_layer = {}
    for name, run in (("memory", mem), ("speed", speed)):
        one, two = (split_bytes(run[k]["saved"], h) for k in ("one_layer", "two_layers"))
        per_layer[name] = (two[0] - one[0], two[1] - one[1])
    (mem_tokens, mem_other), (speed_tokens, speed_other) = per_layer["memory"], per_layer["speed"]
    assert mem_other == speed_other > 0  # attention scores, head- and feature-split tensors: already split
    assert speed_tokens > 0 and mem_tokens * TP <= speed_tokens  # duplicated activations: split by the degree
    saving = (speed_tokens + speed_other) - (mem_tokens + mem_other)
    assert saving >= speed_tokens * (1 - 1 / TP)
    full_shape = (2 * TP, 16, h)  # the joined batch (prescaled_batch false), whole sequence
    assert all(shape != full_shape for shape, _ in mem["one_layer"]["saved"])
    assert any(shape == full_shape for shape, _ in speed["one_layer"]["saved"])


@pytest.mark.slow
def test_sequence_not_divisible_by_the_degree_is_refused(runs):
    for r in runs["memory"]:
        assert r["refusal"].startswith("SMPUnsupportedError: optimize: memory splits the sequence over the 2 "
                                       "tensor-parallel ranks: sequence length 15 is not divisible by "
                                       "tensor_parallel_degree 2"), r["refusal"]
    assert all(r["refusal"] == "no error" for r in runs["speed"])


@pytest.mark.slow
def test_split_dropout_draws_own_masks_per_rank_reproducibly(runs):
    masks = [torch.as_tensor(r["dropout"]["first"]) for r in runs["memory"]]
    for r, first in zip(runs["memory"], masks):
        np.testing.assert_array_equal(r["dropout"]["first"], r["dropout"]["again"])
        assert set(np.unique(r["dropout"]["first"]).tolist()) == {0.0, 2.0}
        assert 0.3 < float((first > 0).float().mean()) < 0.7
    assert not torch.equal(masks[0], masks[1])


@pytest.mark.slow
def test_memory_layout_in_pipeline_stages_trains_like_single_process_hugging_face():
    phase, b, micro = {"optimizer": "sgd", "seed": 2, "steps": 2}, 2, 2
    config = {**BASE, "optimize": "memory", "pipeline_parallel_degree": 2, "microbatches": micro}
    per_rank = run_ranks(sw.pipeline_run, 4, config, phase, b)
    ref = sw.micro_reference(phase, per_rank[0]["data_ranks"], b, micro)
    for got in per_rank:
        # a micro-batch's row joined over the tensor-parallel group, half of the sequence, hidden 16
        assert (TP * b // micro, tw.SEQ // TP, 16) in [tuple(s) for s in got["saved"]]
        np.testing.assert_allclose(got["losses"], [step[got["data_rank"]] for step in ref["losses"]], rtol=1e-4)
        for key, want in ref["weights"].items():
            np.testing.assert_allclose(got["weights"][key], want.numpy(), rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_sequence_collectives_are_conjugate_pairs(runs):
    """all-gather forward / reduce-scatter backward, and reduce-scatter forward / all-gather backward."""
    weight = np.arange(48.0).reshape(2, 8, 3)
    whole_sum = weight * (1 + 2)  # rank r holds arange * (r + 1)
    for rank, r in enumerate(runs["memory"]):
        got, own = r["collectives"], slice(rank * 4, (rank + 1) * 4)
        np.testing.assert_array_equal(got["joined"], np.concatenate([np.full((2, 4, 3), 1.0), np.full((2, 4, 3), 2.0)], 1))
        np.testing.assert_array_equal(got["gather_grad"], TP * weight[:, own])  # every rank's gradient, summed
        np.testing.assert_array_equal(got["part"], whole_sum[:, own])
        np.testing.assert_array_equal(got["scatter_grad"], weight)  # every rank's piece of the gradient, joined
        # one reduce-scatter of the whole tensor (4-byte floats), not an all-reduce (twice the traffic)
        assert got["scatter_ops"] == [("reduce_scatter_tensor", weight.size * 4)], got["scatter_ops"]
