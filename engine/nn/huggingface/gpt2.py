"""``smp.nn.huggingface.gpt2``: GPT-2 state dicts between Hugging Face's names and SMP's
``smp.nn.DistributedTransformerLMHead`` (what ``GPT2LMHeadModel`` becomes under SMP's transformer API).

Hugging Face keeps ``Conv1D`` weights as ``[in, out]`` and q, k, v fused in ``attn.c_attn``; SMP
keeps ``[out, in]`` linear weights and separate ``query`` / ``key`` / ``value``:

===============================  ======================================================
Hugging Face                     SMP
===============================  ======================================================
``transformer.wte``              ``word_embedding``
``transformer.wpe``              ``position_embedding``
``transformer.h.<i>.ln_1``       ``transformer.seq_layers.<i>.attention.layernorm``
``transformer.h.<i>.attn.c_attn``  ``...attention.query`` / ``.key`` / ``.value`` (split, transposed)
``transformer.h.<i>.attn.c_proj``  ``...attention.dense`` (transposed)
``transformer.h.<i>.ln_2``       ``...output.layernorm``
``transformer.h.<i>.mlp.c_fc``   ``...output.dense1`` (transposed)
``transformer.h.<i>.mlp.c_proj`` ``...output.dense2`` (transposed)
``transformer.ln_f``             ``transformer.layernorm``
``lm_head``                      tied to ``word_embedding`` (dropped) or ``lm_head``
===============================  ======================================================

Both directions are exact (transposes and splits only). SMP's checkpoint markers
(``_smp_is_partial``, ``_smp_load_info``) are dropped; an unknown key is refused by name. A state
dict of the in-place sharded Hugging Face model (``model_creation(tensor_parallelism=True)``
without SMP's transformer settings) already has Hugging Face's names: give it to Hugging Face as is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface import count_layers, older_name, same_layout
from smp2ds.engine.nn.huggingface.dt_arguments import activation, gpt_sizes
from smp2ds.engine.nn.parallel.block_rule import BlockRule

_PLAIN_LAYER = {"ln_1": "attention.layernorm", "ln_2": "output.layernorm"}
_T_LAYER = {"attn.c_proj": "attention.dense", "mlp.c_fc": "output.dense1", "mlp.c_proj": "output.dense2"}
_TOP = {"wte.weight": "word_embedding.weight", "wpe.weight": "position_embedding.weight",
        "ln_f.weight": "transformer.layernorm.weight", "ln_f.bias": "transformer.layernorm.bias"}
_QKV = ("query", "key", "value")


def _unknown(fn: str, key: str) -> KeyError:
    return KeyError(f"{fn}: {key!r} is not a GPT-2 parameter name this translator knows")


def _hf_layer_to_smp(key: str, value: torch.Tensor, out: dict[str, Any], fn: str, prefix: str = "",
                     full_key: str | None = None) -> None:
    module, _, leaf = key.rpartition(".")
    if module in _PLAIN_LAYER:
        out[f"{prefix}{_PLAIN_LAYER[module]}.{leaf}"] = value
    elif module in _T_LAYER:
        out[f"{prefix}{_T_LAYER[module]}.{leaf}"] = value.t().contiguous() if leaf == "weight" else value
    elif module == "attn.c_attn":
        parts = (value.t() if leaf == "weight" else value).chunk(3, dim=0)
        for name, part in zip(_QKV, parts, strict=True):
            out[f"{prefix}attention.{name}.{leaf}"] = part.contiguous()
    elif module == "attn" and leaf in ("bias", "masked_bias"):
        return  # old transformers' causal-mask buffers: the SMP layer builds its mask itself
    else:
        raise _unknown(fn, full_key or key)


def _smp_layer_to_hf(sd: Mapping[str, Any], prefix: str, out_prefix: str, fn: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hf, smp in _PLAIN_LAYER.items():
        for leaf in ("weight", "bias"):
            out[f"{out_prefix}{hf}.{leaf}"] = sd[f"{prefix}{smp}.{leaf}"]
    for hf, smp in _T_LAYER.items():
        out[f"{out_prefix}{hf}.weight"] = sd[f"{prefix}{smp}.weight"].t().contiguous()
        out[f"{out_prefix}{hf}.bias"] = sd[f"{prefix}{smp}.bias"]
    out[f"{out_prefix}attn.c_attn.weight"] = torch.cat(
        [sd[f"{prefix}attention.{n}.weight"] for n in _QKV], dim=0).t().contiguous()
    out[f"{out_prefix}attn.c_attn.bias"] = torch.cat([sd[f"{prefix}attention.{n}.bias"] for n in _QKV], dim=0)
    return out


_SMP_LAYER_MODULES = [*_PLAIN_LAYER.values(), *_T_LAYER.values(), *(f"attention.{n}" for n in _QKV)]
_SMP_LAYER_KEYS = {f"{m}.{leaf}" for m in _SMP_LAYER_MODULES for leaf in ("weight", "bias")}


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A Hugging Face ``GPT2LMHeadModel`` (or ``GPT2Model``) state dict -> SMP's names."""
    fn = "translate_hf_state_dict_to_smdistributed_gpt2"
    sd = same_layout(state_dict)
    out: dict[str, Any] = {}
    for key, value in sd.items():
        bare = key[len("transformer."):] if key.startswith("transformer.") else key
        layer = re.fullmatch(r"h\.(\d+)\.(.+)", bare)
        if bare in _TOP:
            out[_TOP[bare]] = value
        elif layer:
            _hf_layer_to_smp(layer.group(2), value, out, fn, f"transformer.seq_layers.{layer.group(1)}.", key)
        elif key == "lm_head.weight":
            wte = sd.get("transformer.wte.weight")
            if wte is None or not torch.equal(value, wte):
                out["lm_head.weight"] = value  # an untied head keeps its own weight
        else:
            raise _unknown(fn, key)
    return out


def translate_state_dict_to_hf_gpt2(state_dict: Mapping[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """An SMP ``DistributedTransformerLMHead`` (GPT-2) state dict -> ``GPT2LMHeadModel``'s names.

    ``max_seq_len`` is accepted for SMP compatibility: current Hugging Face GPT-2 keeps no
    causal-mask buffer in its state dict, so there is nothing to rebuild."""
    fn = "translate_state_dict_to_hf_gpt2"
    sd = same_layout(state_dict)
    out: dict[str, Any] = {}
    inverse = {v: k for k, v in _TOP.items()}
    layers = sorted({int(m.group(1)) for k in sd if (m := re.match(r"transformer\.seq_layers\.(\d+)\.", k))})
    for key, value in sd.items():
        if key in inverse:
            out[f"transformer.{inverse[key]}"] = value
        elif key == "lm_head.weight":
            out[key] = value
        elif not (re.match(r"transformer\.seq_layers\.\d+\.", key)
                  and key.split(".", 3)[3] in _SMP_LAYER_KEYS):
            raise _unknown(fn, key)
    for i in layers:
        out.update(_smp_layer_to_hf(sd, f"transformer.seq_layers.{i}.", f"transformer.h.{i}.", fn))
    if "lm_head.weight" not in out and "word_embedding.weight" in sd:
        out["lm_head.weight"] = sd["word_embedding.weight"]  # tied head
    return out


def translate_hf_state_dict_to_smdistributed_gpt2_layer(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """One ``GPT2Block``'s state dict -> one ``DistributedTransformerLayer``'s."""
    out: dict[str, Any] = {}
    for key, value in same_layout(state_dict).items():
        _hf_layer_to_smp(key, value, out, "translate_hf_state_dict_to_smdistributed_gpt2_layer")
    return out


def translate_state_dict_to_hf_gpt2_layer(state_dict: Mapping[str, Any],
                                          max_seq_len: int | None = None) -> dict[str, Any]:
    """One ``DistributedTransformerLayer``'s state dict -> one ``GPT2Block``'s (``max_seq_len``: as above)."""
    fn = "translate_state_dict_to_hf_gpt2_layer"
    sd = same_layout(state_dict)
    unknown = sorted(set(sd) - _SMP_LAYER_KEYS)
    if unknown:
        raise _unknown(fn, unknown[0])
    return _smp_layer_to_hf(sd, "", "", fn)


translate_hf_state_dict_to_smdistributed = older_name(
    "translate_hf_state_dict_to_smdistributed", translate_hf_state_dict_to_smdistributed_gpt2)


# ---- GPT-2 for the tensor-parallel package and SMP's transformer replacement ------------------------------
BLOCK_RULES = {"GPT2Block": BlockRule("gpt2", column=("attn.c_attn", "mlp.c_fc"), row=("attn.c_proj", "mlp.c_proj"),
                                      heads=("attn.num_heads", "attn.split_size", "attn.embed_dim"),
                                      fused={"attn.c_attn": 3}, conv1d=True)}
"""GPT-2's block sharded in place: ``c_attn`` holds q, k and v one after the other (3 blocks), every projection a
``Conv1D``."""

MODEL_TYPE = "gpt2"


def export_to_hf(state_dict: Mapping[str, Any], num_attention_heads: int) -> dict[str, Any]:
    """Offline export (``smp2ds checkpoint export``): SMP's distributed-transformer names -> Hugging Face's."""
    return translate_state_dict_to_hf_gpt2(state_dict)


def config_from_shapes(state_dict: Mapping[str, Any], num_attention_heads: int) -> dict[str, Any]:
    """A ``config.json`` dict with every size a Hugging Face-named GPT-2 state dict's shapes tell (KeyError when a
    tensor GPT-2 always has is missing)."""
    vocab, hidden = state_dict["transformer.wte.weight"].shape
    return {"model_type": MODEL_TYPE, "vocab_size": vocab, "n_embd": hidden, "n_head": num_attention_heads,
            "n_positions": state_dict["transformer.wpe.weight"].shape[0],
            "n_layer": count_layers(state_dict, r"transformer\.h\.(\d+)\."),
            "n_inner": state_dict["transformer.h.0.mlp.c_fc.weight"].shape[1]}


def gpt2_arguments(config: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """``DistributedTransformerLMHead`` constructor arguments for a GPT-2 config (settings override)."""
    if getattr(config, "add_cross_attention", False):
        raise SMPUnsupportedError("GPT-2 with add_cross_attention=True cannot be replaced by "
                                  "smp.nn.DistributedTransformerLMHead: cross attention is not implemented")
    act = activation("GPT-2", "activation_function", config.activation_function)
    args = {
        **gpt_sizes(config, act),
        "pre_layernorm": True, "post_layernorm": False, "add_lm_head": True,
        "tie_input_output_embedding": bool(getattr(config, "tie_word_embeddings", True)),
        "scale_attention_scores": bool(config.scale_attn_weights),
        "scale_attn_by_layer_idx": bool(config.scale_attn_by_inverse_layer_idx),
        "attention_in_fp32": bool(getattr(config, "reorder_and_upcast_attn", False)),
    }
    return {**args, **settings}
