"""``flash_attention=True`` (PyTorch's scaled_dot_product_attention) in SMP's distributed transformer at
tensor_parallel_degree 1 (no processes).

* Hugging Face GPT-2, GPT-Neo (a global and a local layer), GPT-NeoX and GPT-J (rotary, both layouts) and a
  BERT encoder (no causal mask, post-layernorm), replaced with ``flash_attention=True``, give the logits of
  the replacement with ``flash_attention=False`` and of the Hugging Face model itself, and the same loss
  and gradients (fp32, 1e-5), without padding, with right padding and with left padding;
* every attention option of the eager path (score scaling on/off and by layer index, fp32 attention,
  ``mask_value``, windows) gives the same results through SDPA, also in bf16 (bf16 tolerance);
* attention dropout happens only in training and has the eager path's statistics: with the values set to
  the identity the context *is* the dropped probability matrix, so the fraction of zeroed probabilities,
  the scaling of the kept ones and the mean over many draws are measured directly;
* ``triton_flash_attention`` takes the same path; a value that is not a flag is refused by name;
* ``smp.nn.FlashAttentionLayer`` (packed q/k/v) equals plain PyTorch attention (values and gradients) for
  each way of setting its scale, with and without the causal mask; ALiBi and other shapes are refused.
"""

from __future__ import annotations

import pytest
import torch

import smdistributed.modelparallel.torch as smp
from smp2ds.engine.exceptions import SMPInvalidArgumentError, SMPUnsupportedError
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked
from tests.engine.workers import transformer_workers as tw

FAMILIES = ["gpt2", "gptneo", "neox", "gptj", "bert"]


def replaced(family: str, seed: int, **settings) -> torch.nn.Module:
    """The Hugging Face model of ``family`` (transformer_workers' tiny configs, dropout 0) built marked with
    ``settings`` and replaced by SMP's distributed transformer (BERT: its encoder)."""
    with marks.tensor_parallelism(fused_softmax=True, **settings):
        net = tw.hf_of({"family": family, "seed": seed})
    return replace_marked(net, ParallelContext())


def padded(padding: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, the Hugging Face attention mask (0 = padding) and labels (-100 where no loss is taken)."""
    ids = torch.randint(3, tw.VOCAB, (4, tw.SEQ), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[::2, -3:] = 0
    elif padding == "left":
        mask[1, :2] = 0
    labels = tw.labels_of(ids, mask)
    if padding == "left":
        labels[1, 2] = -100  # a causal LM predicts it from the last padded position, whose output is padding
    return ids, mask, labels


def run(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple:
    """Logits, loss and the gradients of one training-mode forward and backward."""
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close_runs(got: tuple, want: tuple, keep: torch.Tensor, atol: float = 1e-5) -> None:
    assert torch.allclose(got[0][keep], want[0][keep], atol=atol, rtol=0)
    assert torch.allclose(got[1], want[1], atol=atol, rtol=0)
    assert got[2].keys() == want[2].keys()
    for name, grad in want[2].items():
        assert torch.allclose(got[2][name], grad, atol=atol, rtol=1e-4), name


@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_flash_path_equals_eager_path_and_hugging_face(family, padding):
    flash = replaced(family, 3, flash_attention=True).train()
    eager = replaced(family, 3, flash_attention=False).train()
    layers = (flash.bert.encoder if family == "bert" else flash.transformer).seq_layers
    assert all(layer.attention.options.sdpa for layer in layers)
    assert not any(layer.attention.options.sdpa for layer in
                   (eager.bert.encoder if family == "bert" else eager.transformer).seq_layers)
    ids, mask, labels = padded(padding)
    keep = mask.bool()  # padded positions' own outputs are padding (left padding: see engine/nn/flash_attention)
    got = run(flash, ids, mask, labels)
    assert_close_runs(got, run(eager, ids, mask, labels), keep)
    hf = tw.hf_of({"family": family, "seed": 3}).eval()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(got[0][keep], want[keep], atol=1e-5, rtol=0)


LM = {"num_layers": 3, "num_attention_heads": 4, "attention_head_size": 8, "hidden_size": 32,
      "intermediate_size": 64, "vocab_size": 50, "num_positions": 16, "attention_dropout_prob": 0.0,
      "hidden_dropout_prob": 0.0, "embedding_dropout_prob": 0.0}
CAUSAL = {"causal_mask_size": 16, "pre_layernorm": True, "post_layernorm": False}


def lm_pair(dtype: torch.dtype = torch.float32, **extras) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two DistributedTransformerLMHead with the same fresh weights: SDPA and eager attention."""
    models = []
    for flash in (True, False):
        torch.manual_seed(0)
        models.append(smp.nn.DistributedTransformerLMHead(**LM, **extras, flash_attention=flash).to(dtype).train())
    return models[0], models[1]


def lm_run(model: torch.nn.Module, ids: torch.Tensor, pad: torch.Tensor | None) -> tuple:
    """Logits, loss (no loss on padding) and gradients of one training-mode step of an SMP module."""
    model.zero_grad()
    labels = ids if pad is None else ids.masked_fill(pad.bool(), -100)
    loss, logits = model((ids, pad, None, None, labels))
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("extras", [
    {**CAUSAL},
    {**CAUSAL, "scale_attention_scores": False},
    {**CAUSAL, "scale_attn_by_layer_idx": True},
    {**CAUSAL, "attention_in_fp32": True, "mask_value": -1e9},
    {**CAUSAL, "query_key_layer_scaling": True},
    {**CAUSAL, "attention_layers_type": ["local", "global", "local"], "window_size": 2},
    {**CAUSAL, "attention_layers_type": "local", "window_size": 1},  # a query sees only itself
    {**CAUSAL, "rotary_dim": 4, "gpt_neox_type_rotary": True, "use_positional_embedding": False,
     "parallel_attn_output": True},
    {**CAUSAL, "rotary_dim": 8, "use_positional_embedding": False, "parallel_attn_output": True,
     "single_pre_layernorm": True},
    {"pre_layernorm": False, "post_layernorm": True},  # an encoder: no causal mask, only padding
], ids=["causal", "unscaled", "by-layer-idx", "fp32-mask-1e9", "qk-layer-scaling", "windows", "window-1",
        "neox-rotary", "gptj-rotary", "encoder"])
@pytest.mark.parametrize("padded", [False, True])
def test_every_attention_option_gives_the_eager_results(extras, padded):
    flash, eager = lm_pair(**extras)
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(5))
    pad = torch.zeros_like(ids)
    pad[0, -4:] = 1  # 1 = masked (SMP's convention)
    # padded queries' outputs are padding: a local layer's padded query may see no unpadded key at all
    keep = pad == 0 if padded else torch.ones_like(ids, dtype=torch.bool)
    pad = pad if padded else None
    with torch.no_grad():  # q/k weights x10: peaked softmaxes, where masked keys would show if they leaked
        for model in (flash, eager):
            for layer in model.transformer.seq_layers:
                layer.attention.query.weight.mul_(10)
                layer.attention.key.weight.mul_(10)
    assert_close_runs(lm_run(flash, ids, pad), lm_run(eager, ids, pad), keep)


@pytest.mark.parametrize("extras", [{}, {"attention_in_fp32": True}])
def test_bf16_flash_path_stays_within_bf16_rounding_of_the_eager_path(extras):
    flash, eager = lm_pair(torch.bfloat16, **CAUSAL, **extras)
    ids = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        got, want = flash(ids), eager(ids)
    assert got.dtype == want.dtype == torch.bfloat16
    scale = float(want.float().abs().max())
    assert float((got.float() - want.float()).abs().max()) <= 0.02 * scale


def attention_layer(flash: bool, p: float) -> smp.nn.DistributedAttentionLayer:
    torch.manual_seed(0)
    return smp.nn.DistributedAttentionLayer(num_attention_heads=2, attention_head_size=16, hidden_size=32,
                                            attention_dropout_prob=p, hidden_dropout_prob=0.0, causal_mask_size=16,
                                            pre_layernorm=True, post_layernorm=False, flash_attention=flash)


def dropped_probabilities(layer: smp.nn.DistributedAttentionLayer, draws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``draws`` dropped attention-probability matrices ``[draws, N, heads, S, S]`` of one layer (and the
    undropped one), read as the context of values set to the identity (head size = S = 16)."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 2, 16, 16, generator=g) for _ in range(2))
    v = torch.eye(16).expand(2, 2, 16, 16)
    attend = layer._sdpa if layer.options.sdpa else layer._eager
    layer.train()
    dropped = torch.stack([attend(q, k, v, None) for _ in range(draws)])
    layer.eval()
    return dropped, attend(q, k, v, None)


@pytest.mark.parametrize("flash", [True, False])
def test_attention_dropout_has_the_eager_statistics_and_only_in_training(flash):
    p, draws = 0.3, 400
    torch.manual_seed(flash)  # the two paths draw different masks: statistics, not bits, are compared
    dropped, probs = dropped_probabilities(attention_layer(flash, p), draws)
    _, reference = dropped_probabilities(attention_layer(False, 0.0), 1)
    assert torch.allclose(probs, reference, atol=1e-6)  # eval: no dropout, the undropped probabilities
    visible = (probs > 0).expand_as(dropped)
    zeroed = float((dropped[visible] == 0).float().mean())
    n = int(visible.sum())
    assert abs(zeroed - p) < 4 * (p * (1 - p) / n) ** 0.5  # binomial: 4 standard deviations
    kept = dropped != 0
    assert torch.allclose(dropped[kept], (probs / (1 - p)).expand_as(dropped)[kept], atol=1e-5)
    assert torch.equal(dropped[~visible], torch.zeros_like(dropped[~visible]))  # future keys never appear
    # the mean over draws is the undropped matrix: deviations within 5 standard errors of a Bernoulli mean
    stderr = probs * ((p / (1 - p)) / draws) ** 0.5
    assert bool(((dropped.mean(0) - probs).abs() <= 5 * stderr + 1e-6).all())


def test_triton_flash_attention_takes_the_same_path_and_non_flags_are_refused():
    torch.manual_seed(0)
    triton = smp.nn.DistributedTransformerLMHead(**LM, **CAUSAL, triton_flash_attention=True)
    flash, _ = lm_pair(**CAUSAL)
    assert all(layer.attention.options.sdpa for layer in triton.transformer.seq_layers)
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    assert torch.equal(triton(ids), flash(ids))
    smp.nn.DistributedTransformerLMHead(**LM, flash_attention=None, triton_flash_attention=0)
    with pytest.raises(SMPInvalidArgumentError, match=r"flash_attention='yes'\): must be True, False or None"):
        smp.nn.DistributedTransformerLMHead(**LM, flash_attention="yes")
    with pytest.raises(SMPInvalidArgumentError, match=r"triton_flash_attention=2\): must be True, False or None"):
        smp.nn.DistributedAttentionLayer(triton_flash_attention=2)


def explicit_attention(qkv: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float) -> torch.Tensor:
    """Plain PyTorch attention of ``qkv`` ``[B, S, 3, heads, d]``: softmax(scale q k^T + mask) v, ``[B, heads, S, d]``."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(qkv.shape[1], qkv.shape[1], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize(("kwargs", "scale"), [
    ({}, 8 ** -0.5),
    ({"scale_attention_scores": False}, 1.0),
    ({"scale_attn_by_layer_idx": True, "layer_idx": 2}, 8 ** -0.5 / 3),
    ({"attention_head_size": 32}, 32 ** -0.5),
    ({"scale": 0.7, "triton_flash_attention": True}, 0.7),
])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_flash_attention_layer_equals_explicit_attention(kwargs, scale, causal, packed):
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 6, 3, 4, 8, generator=g, requires_grad=True)
    mask = torch.zeros(2, 1, 1, 6)
    mask[1, ..., -2:] = -1e4
    layer = smp.nn.FlashAttentionLayer(attention_dropout_prob=0.1, **kwargs).eval()  # eval: no dropout
    got = layer(qkv.flatten(2, 3) if packed else qkv, attn_mask=mask, causal=causal)
    want = explicit_attention(qkv, mask, causal, scale)
    assert got.shape == (2, 4, 6, 8) and torch.allclose(got, want, atol=1e-6)
    (grad,) = torch.autograd.grad(got.square().sum(), qkv)
    (want_grad,) = torch.autograd.grad(want.square().sum(), qkv)
    assert torch.allclose(grad, want_grad, atol=1e-5)
    assert not torch.allclose(layer.train()(qkv, attn_mask=mask, causal=causal), want, atol=1e-3)  # dropout


def test_flash_attention_layer_refuses_alibi_and_other_shapes():
    smp.nn.FlashAttentionLayer(use_alibi=None)
    with pytest.raises(SMPUnsupportedError, match=r"use_alibi=True\): ALiBi attention biases is not implemented"):
        smp.nn.FlashAttentionLayer(use_alibi=True)
    with pytest.raises(SMPInvalidArgumentError, match=r"scale_attn_by_layer_idx=True, layer_idx=None\)"):
        smp.nn.FlashAttentionLayer(scale_attn_by_layer_idx=True)
    with pytest.raises(SMPInvalidArgumentError, match=r"qkv of shape \(2, 6, 4, 8\)\): qkv must be"):
        smp.nn.FlashAttentionLayer()(torch.zeros(2, 6, 4, 8))
