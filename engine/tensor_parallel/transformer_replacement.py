"""SMP's replacement of Hugging Face models by its distributed transformer: ``GPT2LMHeadModel``,
``GPTNeoForCausalLM``, ``GPTNeoXForCausalLM`` and ``GPTJForCausalLM`` by ``smp.nn.DistributedTransformerLMHead``,
``BertEncoder`` / ``RobertaEncoder`` by ``smp.nn.DistributedTransformer``.

When it applies (the decision, documented): SMP replaced these classes when marked for tensor
parallelism, at any ``tensor_parallel_degree`` including 1, and scripts written for that walk
``model.get_module().transformer.seq_layers``. smp2ds's default for a marked Hugging Face model is to
shard it in place under its own names (:mod:`families`), which keeps Hugging Face scripts (Trainer,
``save_pretrained``, HF state dicts) working. A script asks for SMP's transformer API by passing any
of SMP's distributed-transformer settings to the marking context, as SMP's GPT-2 example does
(``smp.model_creation(tensor_parallelism=True, attention_in_fp32=..., fused_softmax=..., ...)``, or
``smp.tensor_parallelism(fused_softmax=True)``): then the model is replaced, at tp 1 as well. The
settings go to the distributed transformer (unsupported ones are refused there, naming the setting).

What the replacement keeps: the weights Hugging Face initialised or loaded (broadcast from
tensor-parallel rank 0, translated by :mod:`smp2ds.engine.nn.huggingface`, cut to this rank's shard;
weights whose Hugging Face init the script skipped, as SMP's examples do, are drawn afresh instead:
:mod:`smp2ds.engine.nn.huggingface.fresh`), a head tied to the embedding or not as
``config.tie_word_embeddings`` says, ``config``, train/eval mode, dtype
and device, and Hugging Face's call contract (SMP's forward/return hooks): the causal LMs take
``model(input_ids=..., attention_mask=..., labels=...)`` and return ``loss`` / ``logits``; a replaced
encoder takes what ``BertModel`` passes and returns ``last_hidden_state``. The model around a replaced
encoder stays whole. Features the distributed transformer lacks (cross attention, scaled rotary, ...)
are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.core.partitioned_params import gathered_whole
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface import encoder_names
from smp2ds.engine.nn.huggingface.families import ENCODER_ARGUMENTS, LM_REPLACEMENTS
from smp2ds.engine.nn.huggingface.fresh import (
    fill_fresh,
    fresh_value,
    layer_norm_weights,
    with_fresh_weights,
)
from smp2ds.engine.nn.parallel import marks
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.shards import local_part
from smp2ds.engine.nn.transformer import DistributedTransformer, DistributedTransformerLMHead
from smp2ds.engine.tensor_parallel import registry
from smp2ds.engine.tensor_parallel.hf_names import NameTranslation

REPLACED_CLASSES = (*LM_REPLACEMENTS, *ENCODER_ARGUMENTS)
"""Hugging Face classes replaced: GPT-2, GPT-Neo, GPT-NeoX and GPT-J by ``DistributedTransformerLMHead``,
BERT/RoBERTa encoders by ``DistributedTransformer``."""

def wants_replacement(module: torch.nn.Module) -> bool:
    """A marked model whose marking context carries SMP distributed-transformer settings."""
    mark = marks.mark_of(module)
    return bool(mark is not None and mark.enabled and mark.kwargs)


def replace_marked(root: torch.nn.Module, context: ParallelContext) -> torch.nn.Module:
    """``root`` with every model part asking for SMP's transformer API replaced (run by
    ``smp.DistributedModel`` before its backend; returns the new root when ``root`` itself is one), built in
    ``context`` (``smp.init``'s: the tensor-parallel group and its stream, the pipeline degree).

    The Hugging Face model around a replaced encoder (its embeddings, pooler, heads) is unmarked:
    it stays whole on every rank with its weights, as SMP's ``distribute_embedding=False``. Each replacement
    registers its ``(smp_to_hf, hf_to_smp)`` pair in ``smp.state.module_manager.translate_functions``
    (:mod:`hf_names`), as SMP's did."""
    owners: list[torch.nn.Module] = []
    new = _replace(root, context, None, owners, "")
    for owner in owners:
        for m in owner.modules():
            if marks.mark_of(m) is not None:
                marks.keep_whole(m)
    return new


def _replace(module: torch.nn.Module, context: ParallelContext, owner: torch.nn.Module | None, owners: list,
             prefix: str) -> torch.nn.Module:
    """``owner``: the outermost Hugging Face model (a module with ``config``) above ``module``; ``prefix``: the
    state-dict prefix of ``module`` in the wrapped model."""
    owner = owner if owner is not None else (module if hasattr(module, "config") else None)
    kind = _candidate(module)
    if kind is not None:
        _refuse_pipeline(kind, context.pipeline_stages)
        tp = context.tp
        if tp.size > 1:
            registry.sync_replicas(owner or module, tp)  # every rank of the group takes tp rank 0's weights
        if owner is not None and owner is not module and owner not in owners:
            owners.append(owner)
        with gathered_whole(owner or module):  # parameters born partitioned (sdp, delayed init) are read whole
            new = _BUILDERS[kind](module, context)
        translation = _TRANSLATIONS[kind](module, new, prefix)
        state.module_manager.translate_functions.append((translation.smp_to_hf, translation.hf_to_smp))
        return new
    for name, child in list(module.named_children()):
        new = _replace(child, context, owner, owners, f"{prefix}{name}.")
        if new is not child:
            setattr(module, name, new)
    return module


def _refuse_pipeline(kind: str, stages: int) -> None:
    # DistributedTransformerLMHead has a pipeline layer list (engine/pipeline/families/smp_transformer.py);
    # a replaced encoder sits inside a Hugging Face model whose layer list expects the original encoder.
    if stages > 1 and kind.endswith("Encoder"):
        target = "DistributedTransformer"
        raise SMPUnsupportedError(
            f"{kind} replaced by smp.nn.{target} with pipeline_parallel_degree "
            f"{stages}: pipelining the distributed transformer is not implemented; use "
            "pipeline_parallel_degree 1, or build the model without SMP's transformer settings (the Hugging "
            "Face model is then kept and pipelined)")


def _candidate(module: torch.nn.Module) -> str | None:
    if not wants_replacement(module):
        return None
    name = type(module).__name__
    return name if name in REPLACED_CLASSES else None


def to_distributed_transformer(hf: torch.nn.Module, context: ParallelContext) -> torch.nn.Module:
    """The ``DistributedTransformerLMHead`` replacing Hugging Face GPT-2 / GPT-Neo / GPT-NeoX / GPT-J model ``hf``
    in ``context`` (same weights, fresh ones where Hugging Face's init was skipped; head tied as the config
    says)."""
    tp = context.tp
    settings = dict(marks.mark_of(hf).kwargs)
    family = LM_REPLACEMENTS[type(hf).__name__]
    weight = next(hf.parameters())
    if weight.is_meta:  # built under delayed initialisation: shard by shard, never the whole model
        with torch.device("meta"):  # shapes only: only this rank's shards are ever allocated
            new = DistributedTransformerLMHead(**family.arguments(hf.config, settings), parallel_context=context)
        allocate(new, weight.dtype)
        stream_fresh_weights(hf, new, family, tp)
    else:
        new = DistributedTransformerLMHead(**family.arguments(hf.config, settings), parallel_context=context)
        # weights Hugging Face never initialised (its init skipped by the script) are drawn afresh
        weights, _ = with_fresh_weights(hf, hf.state_dict(), hf.config.initializer_range, tp.rng)
        new.to(device=weight.device, dtype=weight.dtype)
        load_full(new, head_as_built(new, family.translate(weights, hf.config)), tp)
    new.train(hf.training)
    object.__setattr__(new, "config", hf.config)
    object.__setattr__(new, "_smp2ds_forward_hook", hf_call_to_smp)
    object.__setattr__(new, "_smp2ds_return_hook", smp_output_to_hf)
    object.__setattr__(new, "_smp2ds_replaced", type(hf).__name__)
    return new


def allocate(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give ``module``'s meta parameters uninitialised CPU storage in ``dtype``, keeping what rides on each
    parameter (its shard spec and tensor-parallel marks: moving off the meta device makes new parameters)."""
    riders = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    module.to_empty(device="cpu").to(dtype=dtype)
    for name, p in module.named_parameters():
        p.__dict__.update(riders[name])


def stream_fresh_weights(hf: torch.nn.Module, new: torch.nn.Module, family: Any, tp: TPGroup) -> None:
    """Give ``new`` (allocated, every value to be written) the fresh weights of ``hf``, a Hugging Face model on the
    meta device (delayed parameter initialisation), one tensor at a time: each full tensor is drawn exactly as
    :func:`with_fresh_weights` draws it (same stream, same order), translated to SMP's names, cut to this rank's
    shard and dropped, so a rank holds its shards and one full tensor at most (none for the tensors it keeps
    whole, which are drawn in place). Every parameter of ``new`` must be written, or the replacement is refused."""
    own = new.state_dict(keep_vars=True)
    range_, norms = hf.config.initializer_range, layer_norm_weights(hf)
    gen = tp.rng.fresh_generator()
    filled: set[str] = set()
    embedding: torch.Tensor | None = None
    params = {name for name, _ in hf.named_parameters(remove_duplicate=False)}
    # buffers are skipped: the translators drop them, and with_fresh_weights draws none for them
    entries = [(key, like) for key, like in hf.state_dict(keep_vars=True).items() if key in params]
    with torch.no_grad():
        for index, (key, like) in enumerate(entries):
            renamed = family.translate({key: like}, hf.config)  # on meta: names and layout only
            if set(renamed) == {"lm_head.weight"} and new.lm_head is None and index == len(entries) - 1:
                break  # a tied head, drawn last: its draw would feed nothing (a full vocabulary-sized tensor)
            if _draw_in_place(renamed, like, own, new):
                (name, _), = renamed.items()
                if own[name].dtype == torch.float32 and own[name].is_contiguous():
                    fill_fresh(own[name], key, range_, gen, key in norms)
                else:
                    own[name].copy_(fresh_value(key, like, range_, gen, key in norms))
                filled.add(name)
                continue
            value = fresh_value(key, like, range_, gen, key in norms)
            for name, full in family.translate({key: value}, hf.config).items():
                if name == "lm_head.weight" and new.lm_head is None:
                    continue  # a tied head is the word embedding
                if name == "word_embedding.weight" and new.lm_head is not None:
                    embedding = full  # an untied head the translator dropped starts as a copy of it
                own[name].copy_(local_part(own[name], full, tp))
                filled.add(name)
    if new.lm_head is not None and "lm_head.weight" not in filled:
        source = embedding if embedding is not None else own["word_embedding.weight"]  # drawn whole in place
        own["lm_head.weight"].copy_(local_part(own["lm_head.weight"], source, tp))
        filled.add("lm_head.weight")
    missing = sorted(set(own) - filled - {k for k, v in own.items() if not isinstance(v, torch.nn.Parameter)})
    if missing:
        raise SMPUnsupportedError(f"{type(hf).__name__} built on the meta device: no fresh weights for "
                                  f"{', '.join(missing)}; turn delayed_parameter_initialization off for this model")


def _draw_in_place(renamed: dict[str, Any], like: torch.Tensor, own: dict[str, Any], new: torch.nn.Module) -> bool:
    """Whether the fresh value of a Hugging Face tensor can be drawn straight into its replacement: it is renamed,
    not reshaped (the translator returned the same tensor), and kept whole on this rank (the embeddings and an
    untied head: the largest tensors, so no second full copy is ever made)."""
    if len(renamed) != 1:
        return False
    (name, value), = renamed.items()
    if value is not like or name not in own or (name == "lm_head.weight" and new.lm_head is None):
        return False
    return tuple(own[name].shape) == tuple(like.shape)


def head_as_built(new: torch.nn.Module, translated: dict[str, Any]) -> dict[str, Any]:
    """``translated`` fitted to the head ``new`` has, which follows ``config.tie_word_embeddings``: a tied
    head is the word embedding (a Hugging Face head left untied, e.g. by a skipped init, is dropped, as
    Hugging Face's ``tie_weights`` would overwrite it); an untied head keeps Hugging Face's weight, or
    starts as a copy of the embedding when the translator dropped a head equal to it."""
    out = dict(translated)
    if new.lm_head is None:
        out.pop("lm_head.weight", None)
    elif "lm_head.weight" not in out:
        out["lm_head.weight"] = out["word_embedding.weight"].clone()
    return out


def load_full(module: torch.nn.Module, full: dict[str, Any], tp: TPGroup) -> None:
    """Load whole tensors into ``module``, cutting each sharded parameter to this rank's piece."""
    own = module.state_dict(keep_vars=True)
    module.load_state_dict({key: local_part(own[key], value, tp) if key in own else value
                            for key, value in full.items()}, strict=True)


_HF_IGNORED = ("return_dict", "use_cache", "output_attentions", "output_hidden_states", "past_key_values",
               "cache_position")


def hf_call_to_smp(input_ids: Any = None, past_key_values: Any = None, attention_mask: Any = None,
                   token_type_ids: Any = None, position_ids: Any = None, *rest: Any, labels: Any = None,
                   **kwargs: Any) -> tuple[tuple, dict]:
    """Hugging Face GPT-2's call -> SMP's tuple ``(input_ids, mask (1 = masked), token types, positions, labels)``."""
    if isinstance(input_ids, (tuple, list)) and past_key_values is None:
        return (input_ids,), {}  # already SMP's tuple form
    used = {k: v for k, v in kwargs.items() if v is not None and k not in _HF_IGNORED}
    if rest or used or (past_key_values is not None) or kwargs.get("output_attentions") \
            or kwargs.get("output_hidden_states"):
        raise SMPUnsupportedError(
            "the GPT-2 model replaced by smp.nn.DistributedTransformerLMHead takes input_ids, attention_mask, "
            f"token_type_ids, position_ids and labels; got also {sorted(used) or 'past_key_values/outputs'}")
    if input_ids is None:
        raise SMPUnsupportedError("the replaced GPT-2 model needs input_ids (inputs_embeds is not supported)")
    if token_type_ids is not None:
        raise SMPUnsupportedError("the GPT-2 model replaced by smp.nn.DistributedTransformerLMHead does not take "
                                  "token_type_ids (GPT-2 has no token-type embedding); pass token_type_ids=None")
    mask = None if attention_mask is None else (1 - attention_mask.long())
    return ((input_ids, mask, token_type_ids, position_ids, labels),), {}


def smp_output_to_hf(out: Any) -> Any:
    """SMP's ``logits`` / ``(loss, logits)`` -> Hugging Face's ``CausalLMOutputWithCrossAttentions``."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    loss, logits = out if isinstance(out, tuple) else (None, out)
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


# ---- BERT / RoBERTa encoders -> DistributedTransformer ---------------------------------------------
def encoder_to_distributed_transformer(encoder: torch.nn.Module, context: ParallelContext) -> torch.nn.Module:
    """The ``DistributedTransformer`` replacing a BERT/RoBERTa encoder in ``context`` (same weights, HF call
    contract)."""
    settings = {k: v for k, v in marks.mark_of(encoder).kwargs.items() if k not in _LM_HEAD_ONLY}
    new = DistributedTransformer(**ENCODER_ARGUMENTS[type(encoder).__name__](encoder.config, settings),
                                 parallel_context=context)
    weight = next(encoder.parameters())
    new.to(device=weight.device, dtype=weight.dtype)
    load_full(new, encoder_names.hf_to_smp(encoder.state_dict(), "encoder replacement"), context.tp)
    new.train(encoder.training)
    object.__setattr__(new, "config", encoder.config)
    object.__setattr__(new, "_smp2ds_forward_hook", hf_encoder_call_to_smp)
    object.__setattr__(new, "_smp2ds_return_hook", smp_encoder_output_to_hf)
    object.__setattr__(new, "_smp2ds_replaced", type(encoder).__name__)
    return new


_LM_HEAD_ONLY = ("vocab_size", "num_positions", "num_token_types", "add_lm_head", "embedding_dropout_prob",
                 "use_positional_embedding", "tie_input_output_embedding", "use_lm_head_bias")


def hf_encoder_call_to_smp(hidden_states: torch.Tensor, attention_mask: Any = None,
                           encoder_hidden_states: Any = None, encoder_attention_mask: Any = None, *rest: Any,
                           **kwargs: Any) -> tuple[tuple, dict]:
    """BertModel's ``encoder(embeddings, attention_mask=...)`` -> SMP's ``((hidden, additive mask),)``."""
    if isinstance(hidden_states, (tuple, list)):
        return (hidden_states,), {}  # already SMP's tuple form
    wants = [k for k in ("output_attentions", "output_hidden_states") if kwargs.get(k)]
    if rest or encoder_hidden_states is not None or encoder_attention_mask is not None or wants:
        raise SMPUnsupportedError("the encoder replaced by smp.nn.DistributedTransformer takes hidden states and "
                                  f"an attention mask only; got also {wants or 'cross-attention inputs'}")
    if attention_mask is not None and attention_mask.dtype == torch.bool:  # sdpa's mask: True = attend
        attention_mask = torch.zeros(attention_mask.shape, dtype=hidden_states.dtype, device=hidden_states.device) \
            .masked_fill(~attention_mask, torch.finfo(hidden_states.dtype).min)
    return ((hidden_states, attention_mask),), {}


def smp_encoder_output_to_hf(out: Any) -> Any:
    """``(hidden, mask)`` -> Hugging Face's encoder output (``last_hidden_state``)."""
    from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions

    return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=out[0])


def _module_name(root: torch.nn.Module, module: Any) -> str | None:
    return next((name for name, m in root.named_modules() if m is module), None)


def lm_names(hf: torch.nn.Module, new: torch.nn.Module, prefix: str) -> NameTranslation:
    """The names of a causal LM replaced by ``new`` (``DistributedTransformerLMHead``), both ways. A tied head is
    written under the Hugging Face head's name too, as ``hf.state_dict()`` has it."""
    family, config = LM_REPLACEMENTS[type(hf).__name__], hf.config
    head, embedding = _module_name(hf, hf.get_output_embeddings()), _module_name(hf, hf.get_input_embeddings())

    def to_hf(sd: dict[str, Any]) -> dict[str, Any]:
        out = family.to_hf(sd, config)
        if new.lm_head is None and head and embedding and f"{head}.weight" not in out:
            out[f"{head}.weight"] = out[f"{embedding}.weight"]
        return out

    return NameTranslation(prefix, frozenset(new.state_dict()), to_hf,
                           lambda sd: head_as_built(new, family.translate(sd, config)))


def encoder_names_of(encoder: torch.nn.Module, new: torch.nn.Module, prefix: str) -> NameTranslation:
    """The names of a BERT/RoBERTa encoder replaced by ``new`` (``DistributedTransformer``), both ways."""
    return NameTranslation(prefix, frozenset(new.state_dict()),
                           lambda sd: encoder_names.smp_to_hf(sd, "smp_to_hf"),
                           lambda sd: encoder_names.hf_to_smp(sd, "hf_to_smp"))


_BUILDERS = {**{name: to_distributed_transformer for name in LM_REPLACEMENTS},
             **{name: encoder_to_distributed_transformer for name in ENCODER_ARGUMENTS}}
_TRANSLATIONS = {**{name: lm_names for name in LM_REPLACEMENTS},
                 **{name: encoder_names_of for name in ENCODER_ARGUMENTS}}
