"""``smp.nn.huggingface.gptneox``: GPT-NeoX state dicts between Hugging Face's names and SMP's
``DistributedTransformerLMHead`` (what ``GPTNeoXForCausalLM`` becomes under SMP's transformer API).

``gpt_neox.embed_in`` <-> ``word_embedding``; ``gpt_neox.layers.<i>.input_layernorm`` /
``post_attention_layernorm`` <-> ``transformer.seq_layers.<i>.attention.layernorm`` /
``output.layernorm``; the fused ``attention.query_key_value`` (laid out per head: q, k, v of head 0,
then of head 1, ...) <-> ``attention.query`` / ``key`` / ``value``; ``attention.dense`` <->
``attention.dense``; ``mlp.dense_h_to_4h`` / ``dense_4h_to_h`` <-> ``output.dense1`` / ``dense2``;
``gpt_neox.final_layer_norm`` <-> ``transformer.layernorm``; ``lm_head`` (``embed_out`` in older
transformers) <-> ``lm_head``. Exact both ways; unknown keys are refused by name. A state dict of the
in-place sharded model already has Hugging Face's names: give it to Hugging Face as is.

Splitting or fusing q/k/v needs the head count. As in SMP, scripts may leave it out: the translators
then use the head count of the last ``GPTNeoXForCausalLM`` replaced by SMP's transformer in this
process (SMP's GPT-NeoX example translates its pretrained weights that way). SMP's signatures are
kept: ``translate_state_dict_to_hf_gptneox(state_dict, max_seq_len=None)`` (``max_seq_len`` is
accepted; current Hugging Face GPT-NeoX keeps no mask buffer to rebuild) and the older
``translate_hf_gptneox_state_dict_to_smdistributed(state_dict, max_seq_len)``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import torch

from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.integrations.transformers_compat import rope_parameters
from smp2ds.engine.nn.huggingface import count_layers, older_name, same_layout
from smp2ds.engine.nn.huggingface.dt_arguments import activation
from smp2ds.engine.nn.parallel.block_rule import BlockRule

_TOP = {"gpt_neox.embed_in.weight": "word_embedding.weight", "gpt_neox.final_layer_norm.weight":
        "transformer.layernorm.weight", "gpt_neox.final_layer_norm.bias": "transformer.layernorm.bias",
        "lm_head.weight": "lm_head.weight"}
_LAYER = {"input_layernorm": "attention.layernorm", "post_attention_layernorm": "output.layernorm",
          "attention.dense": "attention.dense", "mlp.dense_h_to_4h": "output.dense1",
          "mlp.dense_4h_to_h": "output.dense2"}
_QKV = ("query", "key", "value")
def remember_num_attention_heads(heads: int) -> None:
    """Called when a ``GPTNeoXForCausalLM`` is replaced: the head count SMP's head-count-free signatures use,
    kept with the current model in ``smp.state.module_manager`` (``smp.reset`` forgets it)."""
    state.module_manager.gptneox_num_attention_heads = int(heads)


def _heads(given: int | None, fn: str, what: str) -> int:
    if given is not None:
        return int(given)
    remembered = state.module_manager.gptneox_num_attention_heads
    if remembered is not None:
        return remembered
    raise ValueError(f"{fn}: num_attention_heads is needed to {what} (q, k, v per head): pass "
                     "num_attention_heads=, or replace a GPTNeoXForCausalLM first (smp.DistributedModel)")


def _unknown(fn: str, key: str) -> KeyError:
    return KeyError(f"{fn}: {key!r} is not a GPT-NeoX parameter name this translator knows")


def _split_qkv(fused: torch.Tensor, heads: int) -> list[torch.Tensor]:
    per_head = fused.view(heads, 3, -1, *fused.shape[1:])
    return [per_head[:, i].reshape(-1, *fused.shape[1:]).contiguous() for i in range(3)]


def _join_qkv(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    views = [p.view(heads, -1, *p.shape[1:]) for p in parts]
    return torch.stack(views, dim=1).reshape(-1, *parts[0].shape[1:]).contiguous()


def translate_hf_state_dict_to_smdistributed_gptneox(state_dict: Mapping[str, Any],
                                                     num_attention_heads: int | None = None) -> dict[str, Any]:
    """A Hugging Face ``GPTNeoXForCausalLM`` state dict -> SMP's names. The fused q/k/v projection is
    laid out per head, so splitting it needs the head count (``num_attention_heads``, required when
    the state dict has one)."""
    fn = "translate_hf_state_dict_to_smdistributed_gptneox"
    out: dict[str, Any] = {}
    for key, value in same_layout(state_dict).items():
        m = re.fullmatch(r"gpt_neox\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
        key = "lm_head.weight" if key == "embed_out.weight" else key
        if key in _TOP:
            out[_TOP[key]] = value
        elif m and m.group(2) in _LAYER:
            out[f"transformer.seq_layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"] = value
        elif m and m.group(2) == "attention.query_key_value":
            heads = _heads(num_attention_heads, fn, f"split {key!r}")
            for name, part in zip(_QKV, _split_qkv(value, heads), strict=True):
                out[f"transformer.seq_layers.{m.group(1)}.attention.{name}.{m.group(3)}"] = part
        elif not (m and m.group(2).startswith("attention.rotary_emb")):  # old transformers' buffers
            raise _unknown(fn, key)
    return out


def translate_state_dict_to_hf_gptneox(state_dict: Mapping[str, Any], max_seq_len: int | None = None,
                                       num_attention_heads: int | None = None) -> dict[str, Any]:
    """An SMP GPT-NeoX state dict -> ``GPTNeoXForCausalLM``'s names (exact inverse; same ``num_attention_heads``;
    ``max_seq_len``: SMP's argument, nothing to rebuild)."""
    fn = "translate_state_dict_to_hf_gptneox"
    sd = same_layout(state_dict)
    inverse_top = {v: k for k, v in _TOP.items()}
    inverse_layer = {v: k for k, v in _LAYER.items()}
    out: dict[str, Any] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        m = re.fullmatch(r"transformer\.seq_layers\.(\d+)\.(.+)\.(weight|bias)", key)
        if key in inverse_top:
            out[inverse_top[key]] = value
        elif m and m.group(2) in inverse_layer:
            out[f"gpt_neox.layers.{m.group(1)}.{inverse_layer[m.group(2)]}.{m.group(3)}"] = value
        elif m and m.group(2) in {f"attention.{n}" for n in _QKV}:
            fused.setdefault((m.group(1), m.group(3)), {})[m.group(2).split(".")[1]] = value
        else:
            raise _unknown(fn, key)
    for (layer, leaf), parts in fused.items():
        out[f"gpt_neox.layers.{layer}.attention.query_key_value.{leaf}"] = _join_qkv(
            [parts[n] for n in _QKV], _heads(num_attention_heads, fn, f"fuse layer {layer}'s q, k, v"))
    head = _installed_head_name()
    if "lm_head.weight" in out and head != "lm_head.weight":
        out[head] = out.pop("lm_head.weight")
    return out


translate_hf_gptneox_state_dict_to_smdistributed = older_name(
    "translate_hf_gptneox_state_dict_to_smdistributed", translate_hf_state_dict_to_smdistributed_gptneox)


@functools.cache
def _installed_head_name() -> str:
    """The output head's key in the installed transformers' ``GPTNeoXForCausalLM``: ``lm_head.weight``,
    or ``embed_out.weight`` in older releases (5.0). Read from a one-layer model on the meta device."""
    import transformers

    config = transformers.GPTNeoXConfig(num_hidden_layers=1, hidden_size=8, intermediate_size=8,
                                        num_attention_heads=2, vocab_size=8)
    with torch.device("meta"):
        model = transformers.GPTNeoXForCausalLM(config)
    return "embed_out.weight" if hasattr(model, "embed_out") else "lm_head.weight"


# ---- GPT-NeoX for the tensor-parallel package and SMP's transformer replacement ---------------------------
BLOCK_RULES = {"GPTNeoXLayer": BlockRule("gpt_neox", column=("attention.query_key_value", "mlp.dense_h_to_4h"),
                                         row=("attention.dense", "mlp.dense_4h_to_h"),
                                         heads=("attention.num_attention_heads",))}
"""GPT-NeoX's layer sharded in place: ``query_key_value`` is laid out per head (one block)."""

MODEL_TYPE = "gpt_neox"


def export_to_hf(state_dict: Mapping[str, Any], num_attention_heads: int) -> dict[str, Any]:
    """Offline export (``smp2ds checkpoint export``): SMP's distributed-transformer names -> Hugging Face's."""
    return translate_state_dict_to_hf_gptneox(state_dict, num_attention_heads=num_attention_heads)


def config_from_shapes(state_dict: Mapping[str, Any], num_attention_heads: int) -> dict[str, Any]:
    """A ``config.json`` dict with every size a Hugging Face-named GPT-NeoX state dict's shapes tell."""
    vocab, hidden = state_dict["gpt_neox.embed_in.weight"].shape
    return {"model_type": MODEL_TYPE, "vocab_size": vocab, "hidden_size": hidden,
            "num_attention_heads": num_attention_heads,
            "num_hidden_layers": count_layers(state_dict, r"gpt_neox\.layers\.(\d+)\."),
            "intermediate_size": state_dict["gpt_neox.layers.0.mlp.dense_h_to_4h.weight"].shape[0]}


def gptneox_arguments(config: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """``DistributedTransformerLMHead`` arguments for a GPT-NeoX config (rotary, parallel residual)."""
    act = activation("GPT-NeoX", "hidden_act", config.hidden_act)
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") != "default":
        raise SMPUnsupportedError(f"GPT-NeoX rope_type={rope['rope_type']!r} (scaled rotary) is not supported by "
                                  "the distributed transformer; supported: 'default'")
    if not getattr(config, "attention_bias", True):
        raise SMPUnsupportedError("GPT-NeoX with attention_bias=False is not supported by the distributed transformer")
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_size = hidden // heads
    factor = rope.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0))
    args = {
        "num_layers": config.num_hidden_layers, "num_attention_heads": heads, "attention_head_size": head_size,
        "hidden_size": hidden, "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size,
        "num_positions": config.max_position_embeddings, "attention_dropout_prob": config.attention_dropout,
        "hidden_dropout_prob": config.hidden_dropout, "embedding_dropout_prob": config.hidden_dropout,
        "activation": act, "layernorm_epsilon": config.layer_norm_eps,
        "causal_mask_size": config.max_position_embeddings, "initializer_range": config.initializer_range,
        "pre_layernorm": True, "post_layernorm": False, "add_lm_head": True, "use_positional_embedding": False,
        "tie_input_output_embedding": bool(getattr(config, "tie_word_embeddings", False)),
        # Hugging Face rotates 2 * ceil(d / 2) features for d = head_size * factor (one pair per frequency)
        "rotary_dim": 2 * ((int(head_size * factor) + 1) // 2), "rotary_emb_base": rope.get("rope_theta", 10000),
        "gpt_neox_type_rotary": True, "parallel_attn_output": bool(config.use_parallel_residual),
    }
    return {**args, **settings}
