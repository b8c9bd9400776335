"""SMP's distributed transformer at tensor_parallel_degree 2 on 2 real ranks (gloo, DeepSpeed):
a Hugging Face GPT-2 built inside ``smp.model_creation(tensor_parallelism=True, <SMP settings>)``
becomes ``smp.nn.DistributedTransformerLMHead`` (GPT-Neo, GPT-NeoX and GPT-J too; a BERT's encoder
``DistributedTransformer``); its logits equal the Hugging Face model's, each
rank holds half of every split projection, and training (AdamW, and SGD with activation
checkpointing of ``.attention`` / ``.output``) equals single-process Hugging Face GPT-2 training,
weights compared through the ``translate_state_dict_to_hf_<family>`` functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.engine.workers import transformer_workers as tw

B = 3
CONFIG = {"ddp": True, "tensor_parallel_degree": 2, "tensor_parallel_seed": 3}
PHASES = [
    {"optimizer": "adamw", "seed": 1, "steps": 3, "checkpoint": True},
    {"optimizer": "sgd", "seed": 2, "steps": 2, "activation_checkpointing": True},
    {"optimizer": "adamw", "seed": 4, "steps": 2, "family": "bert", "activation_checkpointing": True},
    {"optimizer": "sgd", "seed": 8, "steps": 2, "family": "neox"},
    {"optimizer": "adamw", "seed": 9, "steps": 2, "family": "gptj"},
    {"optimizer": "sgd", "seed": 10, "steps": 2, "family": "gptneo"},
]


RUNS = {
    # id: (world, smp config, phases)
    "tp2": (2, CONFIG, [*PHASES, {"optimizer": "sgd", "seed": 7, "steps": 2, "dropout": 0.2}]),
    "tp2-rdp2-prescaled": (4, {"ddp": True, "tensor_parallel_degree": 2, "prescaled_batch": True}, [
        {"optimizer": "sgd", "seed": 5, "steps": 2},
        {"optimizer": "adamw", "seed": 6, "steps": 2, "family": "bert"},
    ]),
}


@pytest.mark.slow
@pytest.mark.parametrize("run_id", list(RUNS))
def test_tp2_distributed_transformer_matches_hugging_face_gpt2_and_bert(run_id):
    world, config, phases = RUNS[run_id]
    per_rank = run_ranks(tw.run, world, config, phases, B)
    for p, phase in enumerate(phases):
        if phase.get("dropout"):
            _check_dropout_keeps_replicas_equal([r[p] for r in per_rank], tw.hf_of(phase).state_dict())
            continue
        data_ranks = per_rank[0][p]["data_ranks"]
        ref = tw.reference(phase, data_ranks, B)
        hf = tw.hf_of(phase).eval()
        bert = phase.get("family") == "bert"
        prefix = "bert.encoder" if bert else "transformer"
        ids, mask = tw.batch(100, data_ranks * B)
        with torch.no_grad():
            want_logits = hf(input_ids=ids, attention_mask=mask).logits
        for rank in range(world):
            got = per_rank[rank][p]
            r = got["data_rank"]
            assert got["class"] == ("BertForMaskedLM" if bert else "DistributedTransformerLMHead")
            assert got["stack"] == "DistributedTransformer" and got["config_layers"] == 2
            assert got["layers"] == ["DistributedTransformerLayer"] * 2
            keep = mask[r * B:(r + 1) * B].bool()
            np.testing.assert_allclose(got["logits"][keep.numpy()], want_logits[r * B:(r + 1) * B][keep].numpy(),
                                       rtol=1e-5, atol=1e-5)
            local, full = got["shards"][f"{prefix}.seq_layers.0.attention.query.weight"]
            assert local * 2 == full == 16 * 16
            local, full = got["shards"][f"{prefix}.seq_layers.0.output.dense2.weight"]
            assert local * 2 == full == 16 * {None: 64, "gptj": 64, "gptneo": 64}.get(phase.get("family"), 32)
            embedding = "bert.embeddings.word_embeddings.weight" if bert else "word_embedding.weight"
            assert got["shards"][embedding][0] == VOCAB_ROWS * 16  # replicated
            np.testing.assert_allclose(got["losses"], [step[r] for step in ref["losses"]], rtol=1e-4, atol=1e-6)
            assert set(got["weights"]) == set(ref["weights"])
            for key, want in ref["weights"].items():
                np.testing.assert_allclose(got["weights"][key], want.numpy(), rtol=1e-4, atol=1e-5, err_msg=key)
            if phase.get("checkpoint"):  # partial checkpoint of the replaced model -> resume == uninterrupted
                ckpt = got["checkpoint"]
                assert any("0_1" in f for f in ckpt["files"]) and any("0_0" in f for f in ckpt["files"])
                for key, want in ckpt["uninterrupted"].items():
                    np.testing.assert_allclose(ckpt["resumed"][key], want, rtol=1e-6, atol=1e-7, err_msg=key)


VOCAB_ROWS = tw.VOCAB


def _check_dropout_keeps_replicas_equal(runs: list, initial_hf: dict) -> None:
    """With dropout the tensor-parallel ranks must draw the same masks inside the region (the group's
    stream): replicated parameters stay equal on both ranks, split ones differ, and training moved them."""
    a, b = runs[0]["local"], runs[1]["local"]
    replicated = [k for k in a if k.endswith("layernorm.weight") or k.endswith("embedding.weight")]
    assert len(replicated) == 2 * 2 + 1 + 2  # attention/output norms per layer, final norm, 2 embeddings
    for key in replicated:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert not np.array_equal(a["transformer.seq_layers.0.attention.query.weight"],
                              b["transformer.seq_layers.0.attention.query.weight"])
    assert not np.allclose(a["word_embedding.weight"], initial_hf["transformer.wte.weight"].numpy())


@pytest.mark.slow
def test_pipeline_parallelism_with_a_replaced_encoder_is_refused_clearly():
    for message in run_ranks(tw.pipeline_refusal, 2):
        assert message.startswith("SMPUnsupportedError: BertEncoder replaced by smp.nn."
                                  "DistributedTransformer with pipeline_parallel_degree 2: pipelining the "
                                  "distributed transformer is not implemented"), message
