"""SMP's distributed transformer layers: ``DistributedLayerNorm``, ``DistributedAttentionLayer``,
``DistributedTransformerOutputLayer`` and ``DistributedTransformerLayer`` (sizes are global).

Megatron-style tensor parallelism over the tensor-parallel group of the module's parallel context
(``parallel_context=``, else the active one: :mod:`smp2ds.engine.nn.parallel.context`), kept as ``.tp`` and
handed to the sub-layers:

* attention: ``query`` / ``key`` / ``value`` column-parallel (each rank holds ``heads/tp`` whole
  heads), ``dense`` row-parallel (partial products summed, bias added once);
* output (MLP): ``dense1`` column-parallel, activation on the local slice, ``dense2`` row-parallel;
* layer norms, biases of row-parallel projections and embeddings are replicated;
* ``optimize: memory``: between sublayers the hidden states are split along the sequence
  (:mod:`sequence_parallel`).

Parameters are created whole (from the tensor-parallel stream when tp > 1, so every degree draws
the same model) and cut with :func:`shard_parameter`: ``state_dict()`` through the engine joins
them back, and loading full tensors cuts them again.

A module used on its own is a tensor-parallel region (:mod:`region`: batches joined when
``prescaled_batch`` is false, the group's random stream); a module built inside another one runs
inside its parent's region (``_inner``), so regions never nest, also when activation
checkpointing recomputes ``.attention`` or ``.output`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn import flash_attention as fa
from smp2ds.engine.nn import sequence_parallel as seq
from smp2ds.engine.nn import transformer_options as opts
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.collectives import (
    copy_to_tp,
    gather_sequence_linear,
    reduce_from_tp,
    reduce_scatter_sequence,
)
from smp2ds.engine.nn.parallel.context import ParallelContext, resolve
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.modules import DistributedModule
from smp2ds.engine.nn.parallel.region import mark_scaled_batch, run_region
from smp2ds.engine.nn.parallel.shards import ShardSpec, shard_parameter


class DistributedLayerNorm(torch.nn.LayerNorm, DistributedModule):
    """SMP's layer norm (replicated on every tensor-parallel rank: its parameters are small)."""

    def __init__(self, normalized_shape: Any, eps: float = 1e-5):
        super().__init__(normalized_shape, eps=eps)


class ParallelDense(torch.nn.Module):
    """A linear layer (weight ``[out, in]``) split over the group: ``mode`` 'column' splits the
    output features, 'row' the input features (output summed, bias added once).

    ``sequence_split`` (``optimize: memory``): a column layer gets this rank's tokens and joins the group's
    (keeping only its own for backward); a row layer hands back this rank's tokens of the summed output."""

    def __init__(self, in_features: int, out_features: int, mode: str, bias: bool, std: float,
                 gen: torch.Generator | None, tp: TPGroup):
        super().__init__()
        self.mode, self.tp = mode, tp
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features).normal_(0.0, std, generator=gen))
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.tp.size > 1:
            split = 0 if mode == "column" else 1
            for axis, name in ((split, "weight"), (0, "bias")):
                if name == "bias" and (self.bias is None or mode == "row"):
                    continue
                if getattr(self, name).shape[axis] % self.tp.size:
                    raise ValueError(f"{mode}-parallel layer: {name} dimension {getattr(self, name).shape[axis]} is "
                                     f"not divisible by tensor_parallel_degree {self.tp.size}")
                shard_parameter(self, name, ShardSpec(axis, self.tp.size), self.tp.rank)

    def forward(self, x: torch.Tensor, sequence_split: bool = False) -> torch.Tensor:
        if self.mode == "column":
            if sequence_split:
                return gather_sequence_linear(x, [(self.weight, self.bias)], self.tp)[0]
            return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)
        if sequence_split:
            y = reduce_scatter_sequence(F.linear(x, self.weight), self.tp)
            return y if self.bias is None else y + seq.replicated(self.bias, True, self.tp)
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


def init_generator(tp: TPGroup) -> torch.Generator | None:
    """The group's stream for fresh weights when tp > 1 (every rank draws the same tensors)."""
    return tp.rng.init_generator() if tp.size > 1 else None


class RegionModule(DistributedModule):
    """A distributed transformer module: a tensor-parallel region over ``.tp`` unless built inside another."""

    _inner = False
    tp: TPGroup

    def _region(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.tp.size == 1 or self._inner:
            return fn(*args)
        return run_region(self.tp, fn, args, {})

    def _adopt(self) -> None:
        """Mark every distributed submodule as running inside this one's region, and keep the
        tensor-parallel replacement pass away from this tree: it is distributed already (its
        ``nn.Embedding`` must not become another distributed module, its shards not be broadcast)."""
        for m in self.modules():
            if m is not self and isinstance(m, RegionModule):
                m._inner = True
            marks.keep_whole(m)
        if self.tp.size > 1:
            mark_scaled_batch(self)


def _rotary(x: torch.Tensor, dim: int, base: float, neox: bool) -> torch.Tensor:
    """Rotary embedding of the first ``dim`` features of ``x`` [N, heads, S, head size] (positions
    0..S-1). ``neox``: the two halves of those features rotate as pairs (GPT-NeoX); otherwise
    neighbouring features do (GPT-J's interleaved layout)."""
    seq = x.shape[-2]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=x.device), inv_freq)
    rot, rest = x[..., :dim], x[..., dim:]
    if neox:
        angles = torch.cat((angles, angles), dim=-1)
        first, second = rot[..., : dim // 2], rot[..., dim // 2:]
        turned = torch.cat((-second, first), dim=-1)
    else:
        angles = angles.repeat_interleave(2, dim=-1)
        turned = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
    rotated = rot * angles.cos().to(x.dtype) + turned * angles.sin().to(x.dtype)
    return torch.cat((rotated, rest), dim=-1)


def _residual_add(x: torch.Tensor, residual: torch.Tensor, in_fp32: bool) -> torch.Tensor:
    """``x + residual``; ``in_fp32`` (``fp32_residual_addition``): in fp32, and the residual stream stays
    fp32 between layers (Megatron's fp32 residual connection: a 16-bit stream would round after every
    layer and overflow fp16's range)."""
    if in_fp32:
        return x.float() + residual.float()
    return x + residual


def _compute(hidden: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The residual stream in the layer's parameter dtype (a no-op unless the stream is fp32 and the layer
    16-bit, with ``fp32_residual_addition``)."""
    return hidden.to(like.dtype)


def norm(layernorm: torch.nn.LayerNorm, hidden: torch.Tensor, split_over: TPGroup | None = None) -> torch.Tensor:
    """``layernorm(hidden)``; an fp32 residual stream in front of a 16-bit layer norm is normalised in fp32
    (its values may exceed the 16-bit range) and the result cast to the layer's dtype. ``split_over``: the group
    whose ranks each hold some of ``hidden``'s tokens (``optimize: memory``), so the parameters' gradients are
    summed over it; None for whole hidden states."""
    weight = layernorm.weight
    if hidden.dtype == weight.dtype and split_over is None:
        return layernorm(hidden)
    if split_over is not None:
        weight = seq.replicated(weight, True, split_over)
    bias = layernorm.bias if split_over is None else seq.replicated(layernorm.bias, True, split_over)
    if hidden.dtype == weight.dtype:
        return F.layer_norm(hidden, layernorm.normalized_shape, weight, bias, layernorm.eps)
    bias = None if bias is None else bias.float()
    return F.layer_norm(hidden.float(), layernorm.normalized_shape, weight.float(), bias,
                        layernorm.eps).to(weight.dtype)


def _split_inputs(where: str, inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(inputs, torch.Tensor):
        return inputs, None
    if isinstance(inputs, (tuple, list)) and len(inputs) == 2:
        return inputs[0], inputs[1]
    raise TypeError(f"smp.nn.{where}.forward takes (hidden_states, attention_mask) or hidden_states; got "
                    f"{type(inputs).__name__} of length {len(inputs) if hasattr(inputs, '__len__') else '?'}")


class DistributedAttentionLayer(RegionModule):
    """Self attention (SMP signature). ``forward((hidden [N,S,H], mask [N,1,1,S] additive))`` -> hidden."""

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
                 attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, cross_attention: bool = False,
                 causal_mask_size: int | None = None, pre_layernorm: bool = False, post_layernorm: bool = True,
                 *, parallel_context: ParallelContext | None = None, **extras: Any):
        super().__init__()
        self.tp = tp = resolve(parallel_context).tp
        opts.check_no_cross_attention("DistributedAttentionLayer", cross_attention)
        opts.check_layernorms("DistributedAttentionLayer", pre_layernorm, post_layernorm)
        self.options = opts.parse("DistributedAttentionLayer", extras)
        self.layer_idx = int(extras.get("layer_idx", 0) or 0)
        if num_attention_heads % tp.size:
            raise ValueError(f"smp.nn.DistributedAttentionLayer: num_attention_heads {num_attention_heads} is not "
                             f"divisible by tensor_parallel_degree {tp.size}")
        self.num_attention_heads, self.attention_head_size = num_attention_heads, attention_head_size
        self.local_heads = num_attention_heads // tp.size
        self.causal_mask_size, self.pre_layernorm = causal_mask_size, pre_layernorm
        gen, inner = init_generator(tp), num_attention_heads * attention_head_size
        # a fixed draw order (query, key, value, dense) keeps fresh weights the same at any degree
        for name in ("query", "key", "value"):
            setattr(self, name, ParallelDense(hidden_size, inner, "column", self.options.use_qkv_bias,
                                              initializer_range, gen, tp))
        self.dense = ParallelDense(inner, hidden_size, "row", self.options.use_attn_dense_bias, initializer_range, gen,
                                   tp)
        self.layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon)
        self.attention_dropout = torch.nn.Dropout(attention_dropout_prob)
        self.hidden_dropout = torch.nn.Dropout(hidden_dropout_prob)
        self._adopt()

    def forward(self, inputs: Any) -> torch.Tensor:
        hidden, mask = _split_inputs("DistributedAttentionLayer", inputs)
        return self._region(self._forward, hidden, mask)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        n, s, _ = x.shape
        return x.view(n, s, self.local_heads, self.attention_head_size).transpose(1, 2)

    def _forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        hidden, entered = seq.enter(hidden, self.tp)
        return seq.leave(self._body(hidden, mask, seq.is_split(hidden)), entered, self.tp)

    def _body(self, hidden: torch.Tensor, mask: torch.Tensor | None, split: bool) -> torch.Tensor:
        o = self.options
        split_over = self.tp if split else None
        x = norm(self.layernorm, hidden, split_over) if self.pre_layernorm else _compute(hidden, self.layernorm.weight)
        projections = (self.query, self.key, self.value)
        if split:  # one all-gather of the tokens for the three projections
            qkv = gather_sequence_linear(x, [(p.weight, p.bias) for p in projections], self.query.tp)
        else:
            qkv = tuple(proj(x) for proj in projections)
        q, k, v = (self._heads(t) for t in qkv)
        if o.rotary_dim:
            q, k = (_rotary(t, o.rotary_dim, o.rotary_emb_base, o.gpt_neox_type_rotary) for t in (q, k))
        attend = self._sdpa if o.sdpa else self._eager
        context = attend(q, k, v, mask).transpose(1, 2).reshape(hidden.shape[0], q.shape[-2], -1)
        out = seq.dropout(self.hidden_dropout, self.dense(context, split), split, self.tp)
        if o.parallel_attn_output:
            return out  # the layer adds attention, MLP and residual together
        out = _residual_add(out, hidden, o.fp32_residual_addition)
        return out if self.pre_layernorm else norm(self.layernorm, out, split_over)

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The context ``[N, heads, S, head size]`` from explicit scores and probabilities (SMP's reference)."""
        o = self.options
        if o.attention_fp32:
            q, k = q.float(), k.float()
        scores = torch.matmul(q, k.transpose(-1, -2))
        if o.scale_attention_scores:
            scores = scores / math.sqrt(self.attention_head_size)
        if o.scale_attn_by_layer_idx:
            scores = scores / float(self.layer_idx + 1)
        if self.causal_mask_size is not None:
            # a local layer (GPT-Neo) sees only the `window` most recent positions
            causal = fa.causal_keep(scores.shape[-1], o.local_window(self.layer_idx), scores.device)
            scores = scores.masked_fill(~causal, o.mask_value)
        if mask is not None:
            scores = scores + mask.to(scores.dtype)
        probs = self.attention_dropout(torch.softmax(scores, dim=-1).to(v.dtype))
        return torch.matmul(probs, v)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``flash_attention=True``: the same context by PyTorch's fused attention (:mod:`flash_attention`);
        its dropout draws from the current stream, the tensor-parallel group's inside a region."""
        o, drop = self.options, self.attention_dropout
        return fa.sdpa_context(
            q, k, v, mask, causal=self.causal_mask_size is not None, window=o.local_window(self.layer_idx),
            scale=fa.score_scale(self.attention_head_size, o.scale_attention_scores, o.scale_attn_by_layer_idx,
                                 self.layer_idx),
            dropout_p=drop.p if drop.training else 0.0, in_fp32=o.attention_fp32)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class DistributedTransformerOutputLayer(RegionModule):
    """The MLP block (SMP signature): ``dense2(act(dense1(LN?(x))))``, dropout, residual (LN)."""

    def __init__(self, hidden_size: int = 1024, intermediate_size: int = 4096, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, initializer_range: float = 0.02,
                 use_normal_initialization: bool = False, pre_layernorm: bool = False, post_layernorm: bool = True,
                 fp32_residual_addition: bool = False, *, parallel_context: ParallelContext | None = None,
                 **extras: Any):
        super().__init__()
        self.tp = resolve(parallel_context).tp
        opts.check_layernorms("DistributedTransformerOutputLayer", pre_layernorm, post_layernorm)
        self.options = opts.parse("DistributedTransformerOutputLayer",
                                  {**extras, "fp32_residual_addition": fp32_residual_addition})
        self.activation = opts.check_activation("DistributedTransformerOutputLayer", activation)
        self.pre_layernorm = pre_layernorm
        gen = init_generator(self.tp)
        self.dense1 = ParallelDense(hidden_size, intermediate_size, "column", True, initializer_range, gen, self.tp)
        self.dense2 = ParallelDense(intermediate_size, hidden_size, "row", True, initializer_range, gen, self.tp)
        # single_pre_layernorm (GPT-J): the layer hands in the attention's normalised input
        self.layernorm = None if self.options.single_pre_layernorm else \
            DistributedLayerNorm(hidden_size, eps=layernorm_epsilon)
        self.dropout = torch.nn.Dropout(hidden_dropout_prob)
        self._adopt()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._region(self._forward, hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden, entered = seq.enter(hidden, self.tp)
        return seq.leave(self._body(hidden, seq.is_split(hidden)), entered, self.tp)

    def _body(self, hidden: torch.Tensor, split: bool) -> torch.Tensor:
        split_over = self.tp if split else None
        x = norm(self.layernorm, hidden, split_over) if self.pre_layernorm and self.layernorm is not None else \
            _compute(hidden, self.dense1.weight)
        x = seq.dropout(self.dropout, self.dense2(_ACTIVATIONS[self.activation](self.dense1(x, split)), split), split,
                        self.tp)
        if self.options.parallel_attn_output:
            return x
        out = _residual_add(x, hidden, self.options.fp32_residual_addition)
        return out if self.pre_layernorm else norm(self.layernorm, out, split_over)


class DistributedTransformerLayer(RegionModule):
    """``.attention`` then ``.output``; ``forward((hidden, mask))`` -> ``(hidden, mask)`` (SMP's contract)."""

    def __init__(self, num_attention_heads: int = 32, attention_head_size: int = 32, hidden_size: int = 1024,
                 intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 parallel_context: ParallelContext | None = None, **extras: Any):
        super().__init__()
        context = resolve(parallel_context)
        self.tp = context.tp
        opts.check_no_cross_attention("DistributedTransformerLayer", add_cross_attention)
        fp32_residual = bool(extras.pop("fp32_residual_addition", False))
        common = {"layernorm_epsilon": layernorm_epsilon, "initializer_range": initializer_range,
                  "use_normal_initialization": use_normal_initialization, "pre_layernorm": pre_layernorm,
                  "post_layernorm": post_layernorm, "parallel_context": context}
        self.attention = DistributedAttentionLayer(
            num_attention_heads, attention_head_size, hidden_size, attention_dropout_prob, hidden_dropout_prob,
            causal_mask_size=causal_mask_size, fp32_residual_addition=fp32_residual, **common, **extras)
        self.output = DistributedTransformerOutputLayer(
            hidden_size, intermediate_size, hidden_dropout_prob, activation,
            fp32_residual_addition=fp32_residual, **common, **extras)
        self.parallel = bool(extras.get("parallel_attn_output", False))
        self.fp32_residual = fp32_residual
        if bool(extras.get("single_pre_layernorm", False)) and not self.parallel:
            raise SMPUnsupportedError("smp.nn.DistributedTransformerLayer(single_pre_layernorm=True) is implemented "
                                      "with parallel_attn_output=True only (GPT-J)")
        if self.parallel and not pre_layernorm:
            raise SMPUnsupportedError("smp.nn.DistributedTransformerLayer(parallel_attn_output=True) needs "
                                      "pre_layernorm=True (each branch normalises its own input)")
        self._adopt()

    def forward(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, mask = _split_inputs("DistributedTransformerLayer", inputs)
        return self._region(self._forward, hidden, mask)

    def _forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, entered = seq.enter(hidden, self.tp)
        split = seq.is_split(hidden)
        if self.parallel:  # GPT-NeoX: x + attention(LN1(x)) + MLP(LN2(x)); GPT-J: one LN for both
            mlp_in = norm(self.attention.layernorm, hidden, self.tp if split else None) \
                if self.output.layernorm is None else hidden
            mlp = self.output(seq.mark(mlp_in) if split else mlp_in)
            attention = self.attention((hidden, mask))
            out = _residual_add(mlp + attention, hidden, self.fp32_residual)
        else:
            out = self.output(self.attention((hidden, mask)))
        return seq.leave(out, entered, self.tp), mask

