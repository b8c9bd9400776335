"""Hugging Face causal LMs outside the named families, cut by their decoder structure (one process).

Each family's tiny model (fp32, dropout off) is built from a config; its structural layer list
must reproduce the model's own logits, loss and gradients exactly, with a padding mask. Models
whose structure or forward the cut cannot follow are refused by name with the reason. The
tiny models are shared with ``test_pipeline_hf_decoders_dist.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.integrations.transformers_compat import has_masking_utils, is_transformers_5
from smp2ds.engine.pipeline import UnsupportedModelError, build_layer_list
from smp2ds.engine.pipeline.families import hf_decoder
from smp2ds.engine.pipeline.families.probe import run_layers

VOCAB, SEQ = 64, 8
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
           "num_attention_heads": 4, "max_position_embeddings": 32, "pad_token_id": 0, "bos_token_id": 0,
           "eos_token_id": 0}
# family -> (model class, config class, config fields beyond _COMMON): what each one adds to the cut.
FAMILIES = {
    # one sliding window for every layer, narrower than the sequence (so the window masks something)
    "mistral": ("MistralForCausalLM", "MistralConfig", {"num_key_value_heads": 2, "sliding_window": 4}),
    # q/k/v biases; per-layer attention types (full, then sliding): two masks per call
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"num_key_value_heads": 2, "use_sliding_window": True,
                                                   "sliding_window": 4, "max_window_layers": 2}),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"num_key_value_heads": 2, "head_dim": 8}),
    # embedding scaled inside its module, tied head
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {"num_key_value_heads": 2, "head_dim": 8}),
    # embedding dropout, partial rotary, LM head with a bias
    "phi": ("PhiForCausalLM", "PhiConfig", {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}),
    # base model "gpt_neox": embed_in, emb_dropout, layers, final_layer_norm
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {"hidden_dropout": 0.0, "attention_dropout": 0.0}),
    # base model "transformer", blocks "h", tied head, a required alibi argument (None)
    "falcon": ("FalconForCausalLM", "FalconConfig", {"num_kv_heads": 4, "hidden_dropout": 0.0,
                                                      "attention_dropout": 0.0}),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {"resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", {"num_key_value_heads": 4, "hidden_dropout": 0.0}),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", {"num_key_value_heads": 2}),
    # base model "model.decoder": learned positions from the padding mask (offset 2), pre-norm, final_layer_norm
    "opt": ("OPTForCausalLM", "OPTConfig", {"ffn_dim": 64, "word_embed_proj_dim": 32, "dropout": 0.0,
                                            "attention_dropout": 0.0}),
    # narrower embeddings (project_in / project_out around the blocks), post-norm blocks, no final_layer_norm
    "opt_proj": ("OPTForCausalLM", "OPTConfig", {"ffn_dim": 64, "word_embed_proj_dim": 16, "dropout": 0.0,
                                                 "attention_dropout": 0.0, "do_layer_norm_before": False}),
    # no positions: ALiBi biases from the padding mask, rebuilt on each stage; embedding LayerNorm; tied head
    "bloom": ("BloomForCausalLM", "BloomConfig", {"n_head": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    # logits soft-capped (a cap small enough to bend these tiny logits), attention soft-capping, sliding and full
    # layers; the embedding scaled by sqrt(hidden) (in its module on 5.x, in the forward on 4.x)
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {"num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4,
                                                      "final_logit_softcapping": 0.2}),
    # embeddings multiplied and logits divided in the forward; residual and attention multipliers in the blocks
    "granite": ("GraniteForCausalLM", "GraniteConfig", {"num_key_value_heads": 2, "embedding_multiplier": 2.0,
                                                        "logits_scaling": 4.0, "residual_multiplier": 0.5,
                                                        "attention_multiplier": 0.25}),
    # logits multiplied by logit_scale in the forward, tied head, parallel attention and MLP
    "cohere": ("CohereForCausalLM", "CohereConfig", {"num_key_value_heads": 2, "logit_scale": 0.5}),
}


def make_decoder(family: str, seed: int = 0, **overrides) -> nn.Module:
    """The family's tiny model, identical for the same seed."""
    import transformers

    model_cls, config_cls, extra = FAMILIES[family]
    if not hasattr(transformers, model_cls):  # families newer than the oldest supported release
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    fields = {**_COMMON, **extra, **overrides}
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**fields))


def padded_batch(seed: int = 3, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2 % rows, 3:] = 0
    return ids, mask


# ---- the cut reproduces each family exactly -------------------------------------------------------
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_structural_cut_reproduces_logits_loss_and_gradients_exactly(family):
    # Gemma/Gemma2 on 4.57 scale a plain embedding by sqrt(hidden) in the forward (5.x in the embedding module):
    # the cut adds that scaling as a layer of its own
    model = make_decoder(family).train()  # dropout is 0: training mode, as the pipeline runs it
    layer_list = build_layer_list(model)
    assert layer_list.family == FAMILIES[family][0]
    ids, mask = padded_batch()
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    ref = model(**kwargs)
    ref.loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = layer_list.adapter.make_output(run_layers(layer_list, layer_list.adapter.pipe_inputs((), kwargs)), (),
                                         kwargs)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert any(float(g.abs().max()) > 0 for g in ref_grads.values())


def test_layer_names_follow_the_module_tree_and_tied_heads_share_one_key():
    from deepspeed.pipe import TiedLayerSpec

    neox_model = make_decoder("gpt_neox")
    head = next(n for n, m in neox_model.named_modules() if m is neox_model.get_output_embeddings())
    assert head == ("lm_head" if is_transformers_5() else "embed_out")  # transformers 4.57 names it embed_out
    neox = build_layer_list(neox_model)
    assert neox.names == ["gpt_neox.embed_in", "gpt_neox.emb_dropout", *[f"gpt_neox.layers.{i}" for i in range(4)],
                          "gpt_neox.final_layer_norm", head]
    falcon = build_layer_list(make_decoder("falcon"))
    assert falcon.names == ["transformer.word_embeddings", *[f"transformer.h.{i}" for i in range(4)],
                            "transformer.ln_f", "lm_head"]
    ends = [falcon.layers[0].entry, falcon.layers[-1].entry]
    assert all(isinstance(e, TiedLayerSpec) for e in ends) and ends[0].key == ends[1].key
    qwen2 = build_layer_list(make_decoder("qwen2"))
    if has_masking_utils():  # before it, the base model's own mask applies the window (one mask for all blocks)
        assert [layer.entry.attention_type for layer in qwen2.layers[1:5]] == [
            "full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert not any(isinstance(layer.entry, TiedLayerSpec) for layer in qwen2.layers)
    granite = build_layer_list(make_decoder("granite"))  # the forward's scalings: a layer, and the head's ops
    assert granite.names[:2] == ["model.embed_tokens", "model.embed_tokens.scale"]
    assert granite.layers[1].entry.ops == (("mul", 2.0),) and granite.layers[-1].entry.ops == (("div", 4.0),)


def test_opt_layers_hold_positions_projections_and_the_optional_final_norm():
    from deepspeed.pipe import TiedLayerSpec

    blocks = [f"model.decoder.layers.{i}" for i in range(4)]
    opt = build_layer_list(make_decoder("opt"))
    assert opt.family == "OPTForCausalLM"
    assert opt.names == ["model.decoder.embed_tokens", "model.decoder.embed_positions", *blocks,
                         "model.decoder.final_layer_norm", "lm_head"]
    ends = [opt.layers[0].entry, opt.layers[-1].entry]
    assert all(isinstance(e, TiedLayerSpec) for e in ends) and ends[0].key == ends[1].key
    proj_model = make_decoder("opt_proj")
    proj = build_layer_list(proj_model)
    assert proj.names == ["model.decoder.embed_tokens", "model.decoder.embed_positions", *blocks,
                          "model.decoder.project_out", "lm_head"]
    decoder = proj_model.model.decoder
    assert proj.layers[1].entry.project_in is decoder.project_in and proj.layers[-2].entry.norm is None
    # every parameter is held by exactly one layer (the tied pair by both ends)
    held = {id(p) for layer in proj.layers for m in layer.modules for p in m.parameters()}
    assert held == {id(p) for p in proj_model.parameters()}


def test_bloom_layers_and_alibi_rebuilt_from_each_stages_mask():
    model = make_decoder("bloom")
    bloom = build_layer_list(model)
    assert bloom.family == "BloomForCausalLM"
    assert bloom.names == ["transformer.word_embeddings", "transformer.word_embeddings_layernorm",
                           *[f"transformer.h.{i}" for i in range(4)], "transformer.ln_f", "lm_head"]
    ids, mask = padded_batch()
    hidden = torch.randn(ids.shape[0], SEQ, 32)
    block = bloom.layers[2].entry
    with torch.no_grad():  # each block builds its ALiBi positions and causal mask from the mask it is given
        assert not torch.equal(block((hidden, mask))[0], block((hidden, torch.ones_like(mask)))[0])


def test_opt_positions_follow_the_padding_mask_with_offset_two():
    from smp2ds.engine.pipeline.families.opt import opt_positions

    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    assert opt_positions(mask).tolist() == [[0, 1, 2, -1, -1], [-1, -1, 0, 1, 2]]  # looked up at +2


def test_opt_with_layerdrop_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match=r"modeling_opt\.OPTForCausalLM: config\.layerdrop=0\.1 skips "
                                                     "blocks at random"):
        build_layer_list(make_decoder("opt", layerdrop=0.1))


def test_stage_inputs_are_built_once_per_micro_batch_and_rebuilt_for_a_new_one():
    layer_list = build_layer_list(make_decoder("mistral"))
    blocks = [layer.entry for layer in layer_list.layers[1:5]]
    assert len({id(b.shared) for b in blocks}) == 1
    ids, mask = padded_batch()
    hidden = layer_list.layers[0].entry((ids, mask))[0]
    first = blocks[0].shared.get(hidden, mask, blocks[0].rotary_emb)
    assert blocks[1].shared.get(hidden, mask, blocks[1].rotary_emb) is first
    other = mask.clone()
    assert blocks[1].shared.get(hidden, other, blocks[1].rotary_emb) is not first
    mask[1, -1] = 0  # changed in place: rebuilt
    again = blocks[0].shared.get(hidden, mask, blocks[0].rotary_emb)
    assert again is not first and not torch.equal(again[1]["sliding_attention"], first[1]["sliding_attention"])


def test_a_block_behind_an_args_kwargs_wrapper_still_gets_its_named_arguments():
    """A class mixed in front of the block's (as tensor-parallel regions are) hides the names in
    ``forward(*args, **kwargs)``; the cut reads them from the block's own class."""
    model = make_decoder("qwen3")
    for block in model.model.layers:
        base = type(block)
        block.__class__ = type(f"Wrapped{base.__name__}", (base,),
                               {"forward": lambda self, *a, **k: super(type(self), self).forward(*a, **k)})
    layer_list = build_layer_list(model)  # the probe: equal logits with the padding mask
    assert {"attention_mask", "position_ids", "position_embeddings"} <= layer_list.layers[1].entry.args


def test_the_probe_draws_no_random_numbers_and_restores_training_modes():
    model = make_decoder("phi")
    model.train()
    model.model.layers[1].eval()
    state = torch.get_rng_state()
    build_layer_list(model)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and model.model.layers[0].training and not model.model.layers[1].training


def test_a_meta_device_model_is_cut_without_running_it():
    import transformers

    model_cls, config_cls, extra = FAMILIES["qwen3"]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**_COMMON, **extra}))
    assert build_layer_list(model).names[-1] == "lm_head"


# ---- refusals, by model class and reason ------------------------------------------------------------
def _scaled_logits_model() -> nn.Module:
    """A Mistral whose forward doubles the logits: nothing in the module tree shows it."""
    from transformers import MistralForCausalLM

    class ScaledMistralForCausalLM(MistralForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    torch.manual_seed(0)
    return ScaledMistralForCausalLM(make_decoder("mistral").config)


def _refused(name: str) -> nn.Module:

    if name == "scale_emb":  # MiniCPM's setting (remote code): the cut does not scale its embeddings or logits
        return make_decoder("qwen3", scale_emb=12.0)
    if name == "falcon_alibi":
        return make_decoder("falcon", alibi=True)
    if name == "cross_attention":
        return make_decoder("qwen3", add_cross_attention=True)
    if name == "layer_types":
        return make_decoder("qwen3", layer_types=["full_attention", "full_attention", "full_attention",
                                                  "chunked_attention"])
    return _scaled_logits_model()


REFUSALS = {
    "scale_emb": ("Qwen3ForCausalLM", "config.scale_emb=12.0 changes embeddings or logits outside the blocks"),
    "falcon_alibi": ("FalconForCausalLM", "config.alibi=True needs ALiBi biases built per call"),
    "cross_attention": ("Qwen3ForCausalLM", "it has cross attention"),
    "layer_types": ("Qwen3ForCausalLM", "config.layer_types has ['chunked_attention']; the structural cut builds"),
    "scaled_logits": ("ScaledMistralForCausalLM", "on a probe batch its logits differ from embeddings -> blocks"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_models_the_structural_cut_cannot_follow_are_refused_by_class_and_reason(name):
    model_name, reason = REFUSALS[name]
    with pytest.raises(UnsupportedModelError) as err:
        build_layer_list(_refused(name))
    assert isinstance(err.value, SMPUnsupportedError)
    text = str(err.value)
    assert f"pipeline parallelism cannot split a {type(_refused(name)).__module__}.{model_name}: it is not cut as " \
           "a decoder (embedding, ModuleList of blocks, final norm, head) because " in text, text
    assert reason in text, text
    assert "torch.fx" in text  # the traced path was tried too, and says why it failed


def test_models_the_fx_path_serves_are_still_traced():
    """A non-transformers module keeps the torch.fx path (the structural family takes *ForCausalLM only)."""
    class TwoLayers(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    assert not hf_decoder.matches(TwoLayers())
    assert build_layer_list(TwoLayers()).family == "torch.fx traced"


def test_explain_splits_a_structural_decoder_config_as_the_engine_does_and_refuses_alibi_falcon():
    """``smp2ds explain --model``: the split of a meta-device Qwen3 (and OPT) equals the real model's; a Falcon
    with ALiBi says why not."""
    from smp2ds.engine.pipeline import plan_partition
    from smp2ds.engine.pipeline.explain import split_for_model_config

    real = make_decoder("qwen3")
    config = {**real.config.to_dict(), "architectures": ["Qwen3ForCausalLM"]}
    split = split_for_model_config(config, {"pipeline_parallel_degree": 2, "memory_weight": 0.3})
    expected = plan_partition(build_layer_list(real), 2, memory_weight=0.3)
    assert split.plan.parts == expected.parts and split.plan.stages[0].layers[0] == "model.embed_tokens"
    assert split.n_params == sum(p.numel() for p in real.parameters())
    opt = make_decoder("opt")
    opt_split = split_for_model_config({**opt.config.to_dict(), "architectures": ["OPTForCausalLM"]},
                                       {"pipeline_parallel_degree": 2})
    assert opt_split.plan.parts == plan_partition(build_layer_list(opt), 2).parts
    falcon = {"model_type": "falcon", "architectures": ["FalconForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "vocab_size": VOCAB, "alibi": True}
    with pytest.raises(ValueError, match="'FalconForCausalLM' has no pipeline layer list: .*config.alibi=True"):
        split_for_model_config(falcon, {"pipeline_parallel_degree": 2})
