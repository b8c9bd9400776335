"""GPT-Neo replaced by ``smp.nn.DistributedTransformerLMHead`` at tensor_parallel_degree 1 (no processes):
global and local (windowed) attention layers, unscaled fp32 attention scores, no q/k/v bias, a head tied to
the embedding; logits / loss / gradients equal to Hugging Face's for the same weights, the translators'
exact round trip, an SMP state dict loading into the Hugging Face model, and the window's own effect."""

from __future__ import annotations

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smp2ds.engine.exceptions import SMPInvalidArgumentError
from smp2ds.engine.nn.huggingface import gptneo as tr
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked
from tests.engine.hf_equivalence import assert_same_logits_loss_and_gradients, assert_same_state

VOCAB = 40


def hf_neo(seed: int, layers: list[str], window: int = 3):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GPTNeoConfig(num_layers=len(layers), hidden_size=32, num_heads=4, vocab_size=VOCAB,
                          attention_types=[[layers, 1]], window_size=window, max_position_embeddings=16,
                          bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    return tf.GPTNeoForCausalLM(cfg)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def test_gptneo_translators_round_trip_exactly_and_drop_the_tied_head():
    sd = hf_neo(0, ["global", "local"]).state_dict()
    smp_sd = tr.translate_hf_state_dict_to_smdistributed_gptneo(sd)
    assert "transformer.seq_layers.1.attention.query.weight" in smp_sd and "lm_head.weight" not in smp_sd
    back = tr.translate_state_dict_to_hf_gptneo(smp_sd, 16)  # SMP's signature: (state_dict, max_seq_len=None)
    assert_same_state(back, sd)
    older = tr.translate_hf_gptneo_state_dict_to_smdistributed(sd, 16)  # SMP's older name
    assert_same_state(older, smp_sd)
    with pytest.raises(KeyError, match="'transformer.h.0.attn.odd.weight' is not a GPT-Neo parameter name"):
        tr.translate_hf_state_dict_to_smdistributed_gptneo({"transformer.h.0.attn.odd.weight": torch.zeros(1)})


@pytest.mark.parametrize("layers", [["global", "local"], ["local", "global", "local"]])
def test_replaced_gptneo_gives_hf_logits_loss_and_gradients(layers):
    with marks.tensor_parallelism(fused_softmax=True):
        net = hf_neo(4, layers)
    ref = hf_neo(4, layers)
    new = replace_marked(net, ParallelContext())
    assert isinstance(new, smp.nn.DistributedTransformerLMHead) and new.config is net.config
    assert [new.transformer.seq_layers[i].attention.options.local_window(i) for i in range(len(layers))] == \
        [3 if kind == "local" else None for kind in layers]
    assert new.transformer.seq_layers[0].attention.query.bias is None and new.lm_head is None  # tied head
    ids, mask = batch()
    assert_same_logits_loss_and_gradients(new, ref, ids, mask, tr.translate_hf_state_dict_to_smdistributed_gptneo)
    new.eval()
    hf = hf_neo(9, layers).eval()
    hf.load_state_dict(tr.translate_state_dict_to_hf_gptneo(new.state_dict()), strict=True)
    assert torch.allclose(hf(input_ids=ids).logits, new(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_the_window_changes_what_a_local_layer_sees():
    """Not vacuous: with the window the sequence's last positions differ from the all-global model, the
    first `window` positions (which see everything before them either way) do not."""
    with marks.tensor_parallelism(fused_softmax=True):
        local = replace_marked(hf_neo(4, ["local"]), ParallelContext()).eval()
        wide = replace_marked(hf_neo(4, ["global"]), ParallelContext()).eval()
    ids, _ = batch()
    a, b = local(input_ids=ids).logits, wide(input_ids=ids).logits
    assert torch.allclose(a[:, :3], b[:, :3], atol=1e-6) and not torch.allclose(a[:, 3:], b[:, 3:], atol=1e-3)


@pytest.mark.parametrize(("kwargs", "text"), [
    ({"attention_layers_type": ["local", "sliding"], "window_size": 4}, r"each layer's type must be one of"),
    ({"attention_layers_type": "local"}, r"window_size=None\): local attention layers need window_size"),
    ({"attention_layers_type": ["local"], "window_size": 0}, r"window_size=0\)"),
    ({"attention_layers_type": ["local", "global", "local"], "window_size": 2},
     r"attention_layers_type=\[3 entries\]\): one type per layer is needed, num_layers=2"),
])
def test_bad_local_attention_settings_are_refused_naming_them(kwargs, text):
    with pytest.raises(SMPInvalidArgumentError, match=text):
        smp.nn.DistributedTransformer(num_layers=2, num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                      intermediate_size=16, causal_mask_size=8, pre_layernorm=True,
                                      post_layernorm=False, **kwargs)


def test_masked_positions_stay_masked_when_unscaled_scores_are_large():
    """GPT-Neo does not scale its fp32 attention scores; with large q/k weights they pass 1e4 in magnitude,
    where SMP's default mask value (-1e4) would let masked (future) positions win. The replacement masks
    with -1e9 as SMP's GPT-Neo replacement does, and still equals Hugging Face."""
    with marks.tensor_parallelism(fused_softmax=True):
        new = replace_marked(hf_neo(4, ["global", "local"]), ParallelContext()).eval()
    ref = hf_neo(4, ["global", "local"]).eval()
    with torch.no_grad():
        for model, names in ((ref, ("attn.attention.q_proj", "attn.attention.k_proj")),
                             (new, ("attention.query", "attention.key"))):
            for name, p in model.named_parameters():
                if any(n in name for n in names):
                    p.mul_(400)
    ids, _ = batch()
    with torch.no_grad():
        got, want = new(input_ids=ids).logits, ref(input_ids=ids).logits
    # with mask_value -1e4 this differs by thousands (checked when the test was written)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
