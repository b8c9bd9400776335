"""Tensor parallelism keeps pretrained Hugging Face weights (real processes, gloo).

SMP scripts fine-tune at tp > 1 by loading the model with ``from_pretrained`` inside
``smp.model_creation(tensor_parallelism=True)`` and wrapping it. For every family, whether its blocks are
sharded in place (LLaMA, Mistral) or its ``nn.Linear``/``nn.Embedding`` layers are replaced by ``smp.nn``'s
distributed modules (Qwen2, Starcoder2, OLMo2, StableLM, Phi-3, Granite, Falcon), the gathered
``state_dict()`` right after wrapping equals the pretrained one exactly, the logits equal Hugging Face's, and a
few SGD steps equal single-process Hugging Face fine-tuning from the same weights (losses and final weights).
Layouts: tp 2, tp 4, tp 2 x pp 2, and tp 2 x sdp 2 with delayed parameter initialisation.

What cannot be kept is never dropped silently: weights Hugging Face's init skipped start from the distributed
modules' own init (and are reported), a registered class that cannot hold a loaded layer's weights is refused,
naming the layer, and a module outside Hugging Face gets a warning.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.hf_equivalence import close
from tests.engine.workers import tp_pretrained_workers as pw

STEPS, LR = 2, 0.1

LAYOUTS = {
    # id: (world size, SMP parameters, families)
    "tp2": (2, {"ddp": True, "tensor_parallel_degree": 2}, list(pw.FAMILIES)),
    "tp4": (4, {"ddp": True, "tensor_parallel_degree": 4}, ["qwen2", "phi3", "falcon"]),
    "tp2-pp2": (4, {"ddp": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2},
                ["llama", "qwen2", "olmo2", "falcon"]),
    # the tensor-parallel group shares the batch (prescaled); clipping off: the reference does not clip
    "tp2-sdp2-delayed": (4, {"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2,
                             "prescaled_batch": True, "delayed_parameter_initialization": True,
                             "sdp_gradient_clipping": 0.0}, ["llama", "qwen2", "stablelm", "falcon"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pretrained_weights_survive_wrapping_and_fine_tune_like_hugging_face(layout, tmp_path):
    world, config, families = LAYOUTS[layout]
    per_rank = run_ranks(pw.run_fine_tune, world, config, families, STEPS, LR)
    for i, family in enumerate(families):
        ref = pw.reference(pw.save_pretrained(family, str(tmp_path)), STEPS, LR)
        for rank, results in enumerate(per_rank):
            got, what = results[i], f"{layout} rank {rank} {family}"
            assert got["family"] == family
            assert set(got["wrapped"]) == set(ref["pretrained"]), what
            for key, value in ref["pretrained"].items():  # exact: the shards are cut from these tensors
                torch.testing.assert_close(torch.as_tensor(got["wrapped"][key]), value, rtol=0, atol=0,
                                           msg=lambda m, key=key, what=what: f"{what}: {key} after wrapping: {m}")
            close(got["logits"], ref["logits"], f"{what}: logits")
            close(got["losses"], ref["losses"], f"{what}: losses")
            for key, value in ref["weights"].items():
                close(got["weights"][key], value, f"{what}: {key} after {STEPS} steps")


@pytest.mark.slow
def test_weights_that_cannot_be_kept_are_redrawn_refused_or_warned_about():
    per_rank = run_ranks(pw.run_what_cannot_be_kept, 2)
    for out in per_rank:
        skipped = out["skipped"]
        replaced = {f"{layer}.{p}" for layer in ("q_proj", "k_proj", "v_proj", "o_proj") for p in ("weight",)}
        fresh = set(skipped["fresh"])
        assert {f"model.layers.0.self_attn.{name}" for name in replaced} <= fresh
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.down_proj.weight"} <= fresh
        for key in fresh:  # the distributed modules' own init, not what the skipped init left behind
            assert not torch.allclose(torch.as_tensor(skipped["wrapped"][key]), torch.as_tensor(skipped["held"][key]))
        norm = "model.layers.0.input_layernorm.weight"  # not replaced: stays as built
        assert norm not in fresh
        torch.testing.assert_close(torch.as_tensor(skipped["wrapped"][norm]), torch.as_tensor(skipped["held"][norm]))
        assert out["refused"] is not None
        assert "model.layers.0.self_attn.q_proj" in out["refused"] and "_RenamedLinear" in out["refused"]
        assert "load the weights after smp.DistributedModel" in out["refused"]
        assert len(out["warned"]) == 1 and out["warned"][0].startswith("proj: its replacement _RenamedLinear")
