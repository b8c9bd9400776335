"""Find the decoder structure of a Hugging Face causal LM from its module tree and config.

Most ``*ForCausalLM`` models share one shape: a base model (``model``, ``transformer``,
``gpt_neox``, ...) holding a token embedding, an optional embedding dropout and model-level
rotary embedding, one ``ModuleList`` of ``config.num_hidden_layers`` identical blocks and a final
norm; then an output projection. `find_structure` names those parts or says, in words, why the
model is not of that shape (a `NotADecoder` reason), so the caller can refuse it by name.
Nothing here is per family: names come from ``get_input_embeddings`` /
``get_output_embeddings`` / ``base_model_prefix`` and from the module types.

What a model's ``forward`` does to the embeddings or the logits outside any module is read from
its config (`OutsideOps`): Granite's ``embedding_multiplier`` and ``logits_scaling``, Cohere's
``logit_scale``, Gemma 2's ``final_logit_softcapping`` and, on transformers 4.x, Gemma's scaling
of a plain embedding by sqrt(hidden). The probe checks the result against the model's forward.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

ATTENTION_TYPES = ("full_attention", "sliding_attention")
"""``config.layer_types`` values whose masks are built (``create_causal_mask`` / sliding window)."""

# Config settings applied outside the blocks that the cut does not reproduce (value = neutral).
_OUTSIDE_BLOCKS: dict[str, Any] = {
    "scale_emb": 1.0,  # MiniCPM (remote code): embeddings multiplied by it, logits scaled by a width ratio
}
# transformers 4.x ``GemmaModel`` / ``Gemma2Model`` multiply a plain ``nn.Embedding``'s output by
# sqrt(hidden_size) in ``forward``; 5.x moved that into a ``*ScaledWordEmbedding`` module.
_EMBEDDING_NORMALIZED = ("gemma", "gemma2")
# Block arguments the layer wrapper supplies (anything else without a default is refused).
_SUPPLIED = ("attention_mask", "position_ids", "position_embeddings", "alibi", "use_cache", "cache",
             "past_key_values", "layer_past", "output_attentions", "cache_position")


class NotADecoder(Exception):
    """The model is not embeddings -> blocks -> final norm -> head; the message says what differs."""


@dataclass(frozen=True)
class OutsideOps:
    """What the model's ``forward`` does outside its modules, each op as ``(kind, value)``, in order.

    ``embed``: ``("mul", x)`` multiplies the token embeddings by the Python number ``x``;
    ``("mul_tensor", x)`` by ``torch.tensor(x)`` in the embeddings' dtype (Gemma on 4.x).
    ``logits``: ``("mul", x)``, ``("div", x)`` or ``("softcap", x)`` (``tanh(logits / x) * x``).
    The ops and their order are those of the models' own ``forward``, so float results match.
    """

    embed: tuple[tuple[str, float], ...] = ()
    logits: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, eq=False)
class DecoderStructure:
    """The parts of a causal LM, by attribute name under ``base_path``."""

    base_path: str
    base: nn.Module
    embed_name: str
    embed: nn.Embedding
    dropout_name: str | None
    dropout: nn.Module | None
    rotary: nn.Module | None
    blocks_name: str
    blocks: nn.ModuleList
    norm_name: str
    norm: nn.Module
    head_name: str
    head: nn.Linear
    attention_types: tuple[str, ...]
    """Per block: ``full_attention`` or ``sliding_attention``."""
    block_args: frozenset[str]
    """Keyword arguments the blocks' ``forward`` accepts among those the wrapper can supply."""
    outside: OutsideOps = OutsideOps()
    """Scalings of the embeddings and the logits the model's forward applies between its parts."""

    @property
    def tied(self) -> bool:
        return self.head.weight is self.embed.weight


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers ``*ForCausalLM`` with a separate base model (the only models tried here)."""
    base = getattr(model, "base_model", None)
    return (type(model).__name__.endswith("ForCausalLM") and hasattr(model, "config")
            and isinstance(base, nn.Module) and base is not model)


def find_structure(model: nn.Module) -> DecoderStructure:
    """The model's decoder parts, or `NotADecoder` naming what does not fit."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise NotADecoder("it has cross attention (an encoder's states enter every block)")
    for name, neutral in _OUTSIDE_BLOCKS.items():
        value = getattr(config, name, neutral)
        if value is not None and value != neutral:
            raise NotADecoder(f"config.{name}={value!r} changes embeddings or logits outside the blocks")
    outside = outside_ops(model)
    if getattr(config, "alibi", False):
        raise NotADecoder("config.alibi=True needs ALiBi biases built per call, which the structural cut does not")
    head_name, head, base_path, base = _head_and_base(model)
    parts = _base_parts(base, config)
    blocks = parts["blocks"][1]
    return DecoderStructure(
        base_path=base_path, base=base, embed_name=parts["embed"][0], embed=parts["embed"][1],
        dropout_name=parts.get("dropout", (None, None))[0], dropout=parts.get("dropout", (None, None))[1],
        rotary=parts.get("rotary", (None, None))[1],
        blocks_name=parts["blocks"][0], blocks=blocks, norm_name=parts["norm"][0], norm=parts["norm"][1],
        head_name=head_name, head=head, attention_types=_attention_types(config, len(blocks)),
        block_args=_block_args(blocks, has_rotary="rotary" in parts), outside=outside)


def outside_ops(model: nn.Module) -> OutsideOps:
    """The scalings ``model.forward`` applies to the embeddings and logits, read from its config."""
    config = model.config
    embed: list[tuple[str, float]] = []
    if getattr(config, "model_type", None) in _EMBEDDING_NORMALIZED and \
            type(model.base_model.get_input_embeddings()) is nn.Embedding:
        embed.append(("mul_tensor", config.hidden_size ** 0.5))
    multiplier = getattr(config, "embedding_multiplier", 1.0)  # Granite
    if multiplier is not None and multiplier != 1.0:
        embed.append(("mul", multiplier))
    logits: list[tuple[str, float]] = []
    scaling = getattr(config, "logits_scaling", 1.0)  # Granite: divides
    if scaling is not None and scaling != 1.0:
        logits.append(("div", scaling))
    scale = getattr(config, "logit_scale", 1.0)  # Cohere: multiplies
    if scale is not None and scale != 1.0:
        logits.append(("mul", scale))
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3
    if cap:
        logits.append(("softcap", cap))
    return OutsideOps(embed=tuple(embed), logits=tuple(logits))


def _head_and_base(model: nn.Module) -> tuple[str, nn.Linear, str, nn.Module]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise NotADecoder(f"its output projection is {type(head).__name__}, not a torch.nn.Linear")
    children = dict(model.named_children())
    base_path = next((n for n, m in children.items() if m is model.base_model), None)
    head_name = next((n for n, m in children.items() if m is head), None)
    others = sorted(set(children) - {base_path, head_name})
    if base_path is None or head_name is None or others:
        raise NotADecoder(f"besides the base model and the output projection it holds {others or 'nothing'} "
                          "directly, which the structural cut does not place")
    if head.bias is not None and head.weight is model.base_model.get_input_embeddings().weight:
        raise NotADecoder("its output projection is tied to the token embedding and has a bias")
    return head_name, head, base_path, model.base_model


def _base_parts(base: nn.Module, config: Any) -> dict[str, tuple[str, nn.Module]]:
    """Classify the base model's children; refuse any child that is none of the known parts."""
    embed = base.get_input_embeddings()
    n_layers = getattr(config, "num_hidden_layers", None)
    parts: dict[str, tuple[str, nn.Module]] = {}
    for name, child in base.named_children():
        if child is embed:
            kind = "embed"
        elif isinstance(child, nn.ModuleList):
            kind = "blocks"
            if len(child) != n_layers:
                raise NotADecoder(f"its ModuleList {name!r} has {len(child)} entries, config.num_hidden_layers is "
                                  f"{n_layers}")
        elif type(child).__name__.endswith("RotaryEmbedding"):
            kind = "rotary"
        elif isinstance(child, nn.Dropout):
            kind = "dropout"
        elif "norm" in type(child).__name__.lower():
            kind = "norm"
        else:
            raise NotADecoder(f"its base model's child {name!r} ({type(child).__name__}) is not a token embedding, "
                              "embedding dropout, rotary embedding, block list or final norm")
        if kind in parts:
            raise NotADecoder(f"it has two children of one kind ({parts[kind][0]!r} and {name!r})")
        parts[kind] = (name, child)
    for kind in ("embed", "blocks", "norm"):
        if kind not in parts:
            raise NotADecoder(f"its base model has no {'token embedding' if kind == 'embed' else kind} child"
                              f"{' (a ModuleList of blocks)' if kind == 'blocks' else ' (final norm)'}")
    if not isinstance(parts["embed"][1], nn.Embedding):
        raise NotADecoder(f"its token embedding is a {type(parts['embed'][1]).__name__}, not a torch.nn.Embedding")
    return parts


def _attention_types(config: Any, n_blocks: int) -> tuple[str, ...]:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        # Mistral-style configs: one window for every layer when ``sliding_window`` is set.
        kind = "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
        return (kind,) * n_blocks
    types = tuple(layer_types[:n_blocks])
    bad = sorted(set(types) - set(ATTENTION_TYPES))
    if bad:
        raise NotADecoder(f"config.layer_types has {bad}; the structural cut builds masks for {list(ATTENTION_TYPES)}")
    return types


def _block_args(blocks: nn.ModuleList, has_rotary: bool) -> frozenset[str]:
    classes = sorted({type(b).__name__ for b in blocks})
    if len(classes) != 1:
        raise NotADecoder(f"its blocks are of different classes {classes}")
    for sub_name, _ in blocks[0].named_modules():
        if sub_name.split(".")[-1] in ("crossattention", "encoder_attn", "cross_attn"):
            raise NotADecoder(f"its blocks hold cross attention ({sub_name})")
    params = _forward_parameters(blocks[0])[1:]  # after the hidden states
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [p.name for p in params if p.default is p.empty and p.name in named and p.name not in _SUPPLIED]
    if required:
        raise NotADecoder(f"{classes[0]}.forward needs {required}, which the structural cut does not supply")
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    if has_rotary and "position_embeddings" not in named and not takes_kwargs:
        raise NotADecoder(f"{classes[0]}.forward takes no position_embeddings, but the base model has a rotary "
                          "embedding")
    return frozenset(named & set(_SUPPLIED)) | ({"position_embeddings"} if has_rotary else frozenset())


def _forward_parameters(block: nn.Module) -> list[inspect.Parameter]:
    """The block's ``forward`` parameters after ``self``, from the first class in its MRO that names them.

    A wrapper mixed in front of the block's class (a tensor-parallel region) forwards
    ``*args, **kwargs`` to the original ``forward``, whose names are the ones that count.
    """
    for cls in type(block).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        params = list(inspect.signature(forward).parameters.values())[1:]
        if any(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
            return params
    return list(inspect.signature(block.forward).parameters.values())
