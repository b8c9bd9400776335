"""SMP's ``smp.nn.DistributedTransformer`` (``seq_layers``) and ``DistributedTransformerLMHead``.

``DistributedTransformerLMHead``: word + position (+ token-type) embeddings, embedding dropout,
``transformer`` (a :class:`DistributedTransformer`), and an LM head tied to the word embedding
(or its own ``lm_head`` when ``tie_input_output_embedding=False``). By default embeddings and the
head are replicated on every tensor-parallel rank (SMP's ``distribute_embedding=False``) and the
loss is computed outside the module's tensor-parallel region, on this rank's own rows; with
``distribute_embedding=True`` (tp > 1) the vocabulary is split and the loss is a vocab-parallel
cross-entropy computed inside the region (:mod:`vocab_head`). The layers are split Megatron-style
(:mod:`transformer_layers`); with ``optimize: memory`` the stack splits its hidden states along the
sequence on entry and joins them on exit (:mod:`sequence_parallel`), so embeddings and the head see
whole sequences in both layouts.

Forward contracts (SMP's):

* ``DistributedTransformer.forward((hidden [N,S,H], attention_mask [N,1,1,S] additive))`` ->
  ``(hidden, attention_mask)`` after ``seq_layers`` and, for pre-layernorm stacks, the final
  ``layernorm``;
* ``DistributedTransformerLMHead.forward((input_ids, attention_mask, token_type_ids, position_ids,
  labels))`` with ``attention_mask`` 0/1 ``[N,S]``, 1 = masked (any of the last four may be None)
  -> logits ``[N,S,V]`` without labels, ``(loss, logits)`` with labels (causal models shift
  labels by one, ``-100`` is ignored); ``(loss, None)`` with labels and a split vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn import sequence_parallel as seq
from smp2ds.engine.nn import transformer_options as opts
from smp2ds.engine.nn import vocab_head
from smp2ds.engine.nn.parallel.context import ParallelContext, resolve
from smp2ds.engine.nn.transformer_layers import (
    DistributedLayerNorm,
    DistributedTransformerLayer,
    RegionModule,
    init_generator,
    norm,
)


class DistributedTransformer(RegionModule):
    """``num_layers`` x :class:`DistributedTransformerLayer` in ``seq_layers`` (an ``nn.Sequential``)."""

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096, attention_dropout_prob: float = 0.1,
                 hidden_dropout_prob: float = 0.1, activation: str = "gelu", layernorm_epsilon: float = 1e-5,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 parallel_context: ParallelContext | None = None, **extras: Any):
        super().__init__()
        context = resolve(parallel_context)
        self.tp = context.tp
        options = opts.parse("DistributedTransformer", extras)
        opts.check_attention_layers("DistributedTransformer", options, num_layers)
        layer_extras = {k: v for k, v in extras.items() if k != "layer_idx"}
        self.seq_layers = torch.nn.Sequential(*(
            DistributedTransformerLayer(
                num_attention_heads, attention_head_size, hidden_size, intermediate_size, attention_dropout_prob,
                hidden_dropout_prob, activation, layernorm_epsilon, initializer_range, use_normal_initialization,
                causal_mask_size, add_cross_attention, pre_layernorm, post_layernorm, parallel_context=context,
                layer_idx=i, **layer_extras)
            for i in range(num_layers)))
        # a pre-layernorm stack ends un-normalised: SMP closes it with one more layer norm
        self.layernorm = DistributedLayerNorm(hidden_size, eps=layernorm_epsilon) \
            if pre_layernorm or options.final_layernorm else None
        self._adopt()

    def forward(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs, None)
        return self._region(self._forward, *inputs)

    def _forward(self, hidden: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, entered = seq.enter(hidden, self.tp)
        hidden, mask = self.seq_layers((hidden, mask))
        if self.layernorm is not None:
            hidden = norm(self.layernorm, hidden, self.tp if seq.is_split(hidden) else None)
        return seq.leave(hidden, entered, self.tp), mask


class DistributedTransformerLMHead(RegionModule):
    """Embeddings -> :class:`DistributedTransformer` (``.transformer``) -> LM head (SMP signature)."""

    def __init__(self, num_layers: int = 12, num_attention_heads: int = 32, attention_head_size: int = 32,
                 hidden_size: int = 1024, intermediate_size: int = 4096, vocab_size: int = 30522,
                 num_positions: int = 1024, attention_dropout_prob: float = 0.1, hidden_dropout_prob: float = 0.1,
                 activation: str = "gelu", layernorm_epsilon: float = 1e-5, num_token_types: int = 0,
                 causal_mask_size: int | None = None, add_cross_attention: bool = False, add_lm_head: bool = True,
                 initializer_range: float = 0.02, use_normal_initialization: bool = False,
                 pre_layernorm: bool = False, post_layernorm: bool = True, *,
                 parallel_context: ParallelContext | None = None, **extras: Any):
        super().__init__()
        context = resolve(parallel_context)
        self.tp = tp = context.tp
        distribute_embedding = bool(extras.pop("distribute_embedding", False))
        self.options = o = opts.parse("DistributedTransformerLMHead", extras)
        opts.check_no_cross_attention("DistributedTransformerLMHead", add_cross_attention)
        self.causal_mask_size, self.add_lm_head, self.vocab_size = causal_mask_size, add_lm_head, vocab_size
        gen = init_generator(tp)

        def embedding(rows: int) -> torch.nn.Embedding:
            emb = torch.nn.Embedding(rows, hidden_size)
            with torch.no_grad():
                emb.weight.normal_(0.0, initializer_range, generator=gen)
            return emb

        self.word_embedding = embedding(vocab_size)
        self.position_embedding = embedding(num_positions) if o.use_positional_embedding else None
        self.token_type_embedding = embedding(num_token_types) if num_token_types > 0 else None
        self.embedding_dropout = torch.nn.Dropout(o.embedding_dropout_prob)
        layer_extras = {k: v for k, v in extras.items() if k not in _HEAD_ONLY}
        self.transformer = DistributedTransformer(
            num_layers, num_attention_heads, attention_head_size, hidden_size, intermediate_size,
            attention_dropout_prob, hidden_dropout_prob, activation, layernorm_epsilon, initializer_range,
            use_normal_initialization, causal_mask_size, add_cross_attention, pre_layernorm, post_layernorm,
            parallel_context=context, **layer_extras)
        self.lm_head = None
        if add_lm_head and not o.tie_input_output_embedding:
            self.lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False)
            with torch.no_grad():
                self.lm_head.weight.normal_(0.0, initializer_range, generator=gen)
        self.lm_head_bias = torch.nn.Parameter(torch.zeros(vocab_size)) if add_lm_head and o.use_lm_head_bias \
            else None
        self.vocab_parallel = distribute_embedding and tp.size > 1
        if self.vocab_parallel:
            vocab_head.split_vocabulary(self, tp)
        self._adopt()

    def forward(self, inputs: Any) -> Any:
        ids, mask, token_types, positions, labels = unpack_lm_inputs(inputs)
        if self.vocab_parallel and labels is not None and self.add_lm_head:
            # the loss is computed inside the region from vocab-split logits, which are never joined
            per_token, valid = self._region(self._forward_loss, ids, mask, token_types, positions, labels)
            return per_token.sum() / valid.sum(), None
        out = self._region(self._forward, ids, mask, token_types, positions)
        if labels is None:
            return out
        return self.loss(out, labels), out

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor | None, token_types: torch.Tensor | None,
                 positions: torch.Tensor | None) -> torch.Tensor:
        hidden = self._hidden(ids, mask, token_types, positions)
        if not self.add_lm_head:
            return hidden
        if self.vocab_parallel:
            return vocab_head.full_logits(self, hidden)
        head = self.word_embedding.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, head, self.lm_head_bias)

    def _forward_loss(self, ids: torch.Tensor, mask: torch.Tensor | None, token_types: torch.Tensor | None,
                      positions: torch.Tensor | None, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self._hidden(ids, mask, token_types, positions)
        return vocab_head.token_losses(self, hidden, labels, shift=self.causal_mask_size is not None)

    def _hidden(self, ids: torch.Tensor, mask: torch.Tensor | None, token_types: torch.Tensor | None,
                positions: torch.Tensor | None) -> torch.Tensor:
        hidden = self.word_embedding(ids)
        if self.position_embedding is not None:
            if positions is None:
                positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            hidden = hidden + self.position_embedding(positions)
        elif positions is not None:
            raise SMPUnsupportedError("smp.nn.DistributedTransformerLMHead without a position embedding (rotary) "
                                      "takes no position_ids: its positions are 0..S-1; pass position_ids=None")
        if self.token_type_embedding is not None and token_types is not None:
            hidden = hidden + self.token_type_embedding(token_types)
        additive = None
        if mask is not None:  # 1 = masked -> mask_value added to those keys' scores
            additive = (mask.to(hidden.dtype) * self.options.mask_value)[:, None, None, :]
        if self.options.fp32_residual_addition:
            hidden = hidden.float()  # the residual stream is fp32 from the embeddings on
        return self.transformer((self.embedding_dropout(hidden), additive))[0]

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over labels != -100 (shifted by one position for causal models)."""
        if self.causal_mask_size is not None:
            logits, labels = logits[:, :-1, :], labels[:, 1:]
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


_HEAD_ONLY = ("embedding_dropout_prob", "use_positional_embedding", "tie_input_output_embedding",
              "use_lm_head_bias", "vocab_size", "num_positions", "num_token_types", "add_lm_head")


def unpack_lm_inputs(inputs: Any) -> tuple[Any, Any, Any, Any, Any]:
    """``DistributedTransformerLMHead``'s input, ``input_ids`` or a tuple of up to five, as (input_ids,
    attention_mask, token_type_ids, position_ids, labels); the pipeline's first stage reads it the same way."""
    if isinstance(inputs, torch.Tensor):
        return inputs, None, None, None, None
    if not isinstance(inputs, (tuple, list)) or not 1 <= len(inputs) <= 5:
        raise TypeError("smp.nn.DistributedTransformerLMHead.forward takes input_ids or a tuple (input_ids, "
                        "attention_mask, token_type_ids, position_ids, labels); cross-attention inputs are not "
                        f"supported; got {type(inputs).__name__}")
    padded = list(inputs) + [None] * (5 - len(inputs))
    return padded[0], padded[1], padded[2], padded[3], padded[4]
