"""SMP's ``flash_attention=True`` (and ``triton_flash_attention=True``): the distributed transformer's
attention computed by ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

SDPA picks its kernel from the inputs: on GPUs FlashAttention or the memory-efficient kernel, on CPU a
fused CPU kernel without dropout; these never hold the ``[N, heads, S, S]`` score and probability matrices
for backward (``bench/attention_memory.py``). Otherwise (CPU with attention dropout) SDPA's math kernel
computes what the eager path does. Every option of the eager path is expressed through SDPA's arguments:

* the score scale (``scale_attention_scores``, ``scale_attn_by_layer_idx``) is SDPA's ``scale``;
* ``attention_in_fp32`` / ``query_key_layer_scaling``: q, k and v go in as fp32, the context is cast back;
* the causal mask alone is ``is_causal=True`` (the mask the GPU flash kernels take); a local (GPT-Neo)
  window is a boolean ``attn_mask``; with an additive padding mask both become one float ``attn_mask``;
* attention dropout is SDPA's ``dropout_p`` in training mode, drawn from the current generator, which
  inside a tensor-parallel region is the group's stream (as the eager ``nn.Dropout``'s).

:class:`FlashAttentionLayer` is SMP's stand-alone ``smp.nn.FlashAttentionLayer`` on the same function.

The one difference from the eager path: causally hidden (and out-of-window) positions are masked with
``-inf`` (SDPA's own causal mask) where the eager path writes ``mask_value`` into their scores. Both give
them probability exactly 0 once the visible scores exceed ``mask_value`` by more than ~104 (fp32
``exp`` underflow), which holds for SMP's ``-1e4`` and GPT-Neo's ``-1e9`` in any trained model, so
results agree to rounding. Padding stays additive (the caller's ``mask_value`` rows), as in the eager path.
A padded query whose every visible key is padding too (left padding, or a local window inside right
padding) is the one place the paths part: the eager path then spreads it over the unpadded keys it should
not see as well (their scores are ``mask_value``, its visible keys' ``score + mask_value``), SDPA over its
visible padded keys only. That output is padding in both; the outputs of unpadded positions, a loss on
them and the gradients are the same.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from smp2ds.engine.exceptions import SMPInvalidArgumentError, SMPUnsupportedError
from smp2ds.engine.nn.parallel.modules import DistributedModule


def score_scale(head_size: int, scale_scores: bool, by_layer_idx: bool, layer_idx: int) -> float:
    """The factor the eager path applies to ``q @ k^T``: ``1/sqrt(head_size)`` unless
    ``scale_attention_scores`` is off, divided by ``layer_idx + 1`` with ``scale_attn_by_layer_idx``."""
    scale = 1.0 / math.sqrt(head_size) if scale_scores else 1.0
    return scale / float(layer_idx + 1) if by_layer_idx else scale


def causal_keep(seq: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[seq, seq]`` bool, True where a query (row) may see a key (column): itself and earlier positions,
    only the ``window`` most recent of them for a local layer."""
    keep = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    return keep if window is None else keep.triu(1 - window)


def sdpa_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *, scale: float,
                 causal: bool, window: int | None, dropout_p: float, in_fp32: bool) -> torch.Tensor:
    """The attention context ``[N, heads, S, head size]`` of q, k, v ``[N, heads, S, head size]``.

    ``mask``: additive (``[N, 1, 1, S]`` or anything broadcasting to ``[N, heads, S, S]``), or None;
    ``causal``/``window``: the causal mask and a local layer's window; ``dropout_p``: 0 outside training."""
    dtype = v.dtype
    if in_fp32:
        q, k, v = q.float(), k.float(), v.float()
    attn_mask: torch.Tensor | None = None
    is_causal = causal and window is None and mask is None  # the form the GPU flash kernels accept
    if causal and not is_causal:
        attn_mask = causal_keep(q.shape[-2], window, q.device)
    if mask is not None:
        additive = mask.to(q.dtype)
        attn_mask = additive if attn_mask is None else torch.where(attn_mask, additive, float("-inf"))
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                             is_causal=is_causal, scale=scale)
    return context.to(dtype)


class FlashAttentionLayer(DistributedModule):
    """SMP's ``smp.nn.FlashAttentionLayer``: attention of packed q/k/v by SDPA (no parameters).

    ``forward(qkv, attn_mask=None, causal=False)``: ``qkv`` ``[B, S, 3, heads, head size]`` (or
    ``[B, S, 3 * heads, head size]``, the same memory), ``attn_mask`` additive ``[B, 1, 1, S]``; returns
    ``[B, heads, S, head size]``. The scale is ``scale`` when given, else ``1/sqrt(head size)`` (1 with
    ``scale_attention_scores=False``) divided by ``layer_idx + 1`` with ``scale_attn_by_layer_idx``.
    ``triton_flash_attention`` picks a kernel in SMP: the same SDPA here. ALiBi is refused."""

    def __init__(self, attention_dropout_prob: float = 0.1, attention_head_size: int | None = None,
                 scale_attention_scores: bool = True, scale_attn_by_layer_idx: bool = False,
                 layer_idx: int | None = None, scale: float | None = None, triton_flash_attention: bool = False,
                 use_alibi: bool = False):
        super().__init__()
        if use_alibi:
            raise SMPUnsupportedError(f"smp.nn.FlashAttentionLayer(use_alibi={use_alibi!r}): ALiBi attention biases "
                                      "is not implemented by smp2ds; supported: use_alibi in (False, None)")
        if scale_attn_by_layer_idx and layer_idx is None and scale is None:
            raise SMPInvalidArgumentError("smp.nn.FlashAttentionLayer(scale_attn_by_layer_idx=True, layer_idx=None): "
                                          "scaling by the layer index needs layer_idx (or give scale)")
        self.attention_head_size, self.scale = attention_head_size, scale
        self.scale_attention_scores, self.scale_attn_by_layer_idx = scale_attention_scores, scale_attn_by_layer_idx
        self.layer_idx = int(layer_idx or 0)
        self.dropout = torch.nn.Dropout(attention_dropout_prob)

    def forward(self, qkv: torch.Tensor, attn_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        if qkv.dim() == 4 and qkv.shape[2] % 3 == 0:
            qkv = qkv.unflatten(2, (3, -1))
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise SMPInvalidArgumentError(
                f"smp.nn.FlashAttentionLayer.forward(qkv of shape {tuple(qkv.shape)}): qkv must be "
                "[batch, seq, 3, heads, head size] or [batch, seq, 3 * heads, head size]")
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, S, head size]
        scale = self.scale if self.scale is not None else score_scale(
            self.attention_head_size or q.shape[-1], self.scale_attention_scores, self.scale_attn_by_layer_idx,
            self.layer_idx)
        return sdpa_context(q, k, v, attn_mask, scale=scale, causal=causal, window=None,
                            dropout_p=self.dropout.p if self.training else 0.0, in_fp32=False)
