"""The extra keyword arguments SMP's distributed transformer modules take, checked in one place.

Each ``smp.nn.DistributedTransformer*`` constructor accepts SMP's extras
(docs/smp-semantics.md#tensor-parallelism). Every extra is either implemented (:class:`Options`
carries it to the layers), accepted because it only picks a kernel (smp2ds runs PyTorch's kernels:
the maths is the same), or refused with an error naming it, the value given and what is supported.
Unknown names are refused too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smp2ds.engine.exceptions import SMPInvalidArgumentError, SMPUnsupportedError


@dataclass(frozen=True)
class Options:
    """The extras the layers act on (defaults are SMP's)."""

    mask_value: float = -1e4
    attention_in_fp32: bool = False
    query_key_layer_scaling: bool = False
    fp32_residual_addition: bool = False
    scale_attention_scores: bool = True
    scale_attn_by_layer_idx: bool = False
    use_qkv_bias: bool = True
    use_attn_dense_bias: bool = True
    embedding_dropout_prob: float = 0.1
    use_positional_embedding: bool = True
    tie_input_output_embedding: bool = True
    use_lm_head_bias: bool = False
    final_layernorm: bool = False
    rotary_dim: int | None = None
    rotary_emb_base: float = 10000
    gpt_neox_type_rotary: bool = False
    parallel_attn_output: bool = False
    single_pre_layernorm: bool = False
    attention_layers_type: str | tuple[str, ...] | None = None
    """'global' or 'local' for every layer, or one of them per layer (GPT-Neo's ``attention_layers``)."""
    window_size: int | None = None
    """Local layers attend to the ``window_size`` most recent positions, their own included."""
    flash_attention: bool = False
    """Attention by ``torch.nn.functional.scaled_dot_product_attention`` (:mod:`flash_attention`)."""
    triton_flash_attention: bool = False
    """SMP's Triton FlashAttention kernel (for ALiBi, refused): the same SDPA path here."""

    @property
    def sdpa(self) -> bool:
        """True when attention runs through PyTorch's fused SDPA instead of explicit scores."""
        return bool(self.flash_attention or self.triton_flash_attention)

    @property
    def attention_fp32(self) -> bool:
        """Scores and softmax in fp32 (``attention_in_fp32``; ``query_key_layer_scaling`` amounts to the same)."""
        return bool(self.attention_in_fp32 or self.query_key_layer_scaling)

    def local_window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` if it is a local layer, else None (global)."""
        kind = self.attention_layers_type
        if isinstance(kind, tuple):
            kind = kind[layer_idx] if layer_idx < len(kind) else None
        return self.window_size if kind == "local" else None


KERNEL_CHOICES = ("fused_softmax", "fused_dropout", "fused_bias_gelu")
"""Accepted with any value: they choose CUDA kernels; smp2ds computes the same maths with PyTorch's."""

_IGNORED_POSITIONAL = ("layer_idx", "input_layer", "output_layer", "full_attention_mask_and_cross_states")
"""Bookkeeping SMP passes between its own layers (``layer_idx`` is read where it matters)."""

_REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "distribute_embedding": (False, None),  # DistributedTransformerLMHead takes it before parse
    "rotary_pct": (None,),
    "use_alibi": (False, None),
    "alibi_bias_max": (8, None),
    "_output_full_batch": (False, None),
}
"""Extras smp2ds does not implement: only their 'off' values are accepted."""

_WHY = {
    "distribute_embedding": "a vocab-parallel embedding outside DistributedTransformerLMHead (which owns the "
                            "embedding and implements it)",
    "rotary_pct": "rotary_pct (give rotary_dim, the number of rotated features per head)",
    "use_alibi": "ALiBi attention biases",
    "alibi_bias_max": "ALiBi attention biases",
    "_output_full_batch": "full-batch outputs of a prescaled region",
}


def parse(where: str, extras: dict[str, Any]) -> Options:
    """Check ``extras`` given to ``where`` (a class name) and return the ones the layers use."""
    fields = set(Options.__dataclass_fields__)
    used: dict[str, Any] = {}
    for key, value in extras.items():
        if key in fields:
            used[key] = value
        elif key in KERNEL_CHOICES or key in _IGNORED_POSITIONAL:
            continue
        elif key in _REFUSED_UNLESS:
            if value not in _REFUSED_UNLESS[key]:
                allowed = ", ".join(repr(v) for v in _REFUSED_UNLESS[key])
                raise SMPUnsupportedError(
                    f"smp.nn.{where}({key}={value!r}): {_WHY[key]} is not implemented by smp2ds; "
                    f"supported: {key} in ({allowed})")
        else:
            raise SMPInvalidArgumentError(
                f"smp.nn.{where} got unknown keyword argument {key!r}={value!r}; accepted extras: "
                f"{sorted(fields | set(KERNEL_CHOICES) | set(_IGNORED_POSITIONAL) | set(_REFUSED_UNLESS))}")
    if not used.get("rotary_dim"):
        used["rotary_dim"] = None
    _check_local_attention(where, used)
    _check_flash_flags(where, used)
    return Options(**used)


_FLASH_FLAGS = ("flash_attention", "triton_flash_attention")


def _check_flash_flags(where: str, used: dict[str, Any]) -> None:
    """``flash_attention`` / ``triton_flash_attention``: True, False or None (SMP's 'not given'); 0/1 too, as
    scripts pass ``args.flash_attention > 0`` as often as an int flag."""
    for key in _FLASH_FLAGS:
        value = used.get(key)
        if value is not None and not (isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))):
            raise SMPInvalidArgumentError(f"smp.nn.{where}({key}={value!r}): must be True, False or None (both "
                                          "flash settings select PyTorch's scaled_dot_product_attention)")
        used[key] = bool(value)


_ATTENTION_KINDS = ("global", "local")


def _check_local_attention(where: str, used: dict[str, Any]) -> None:
    """``attention_layers_type`` ('global' / 'local', or a list of them) and the ``window_size`` local layers need."""
    kind = used.get("attention_layers_type")
    kinds = list(kind) if isinstance(kind, (list, tuple)) else [kind]
    if isinstance(kind, (list, tuple)):
        used["attention_layers_type"] = tuple(kind)
    bad = [k for k in kinds if k is not None and k not in _ATTENTION_KINDS]
    if bad or (isinstance(kind, (list, tuple)) and None in kinds):
        raise SMPInvalidArgumentError(
            f"smp.nn.{where}(attention_layers_type={kind!r}): each layer's type must be one of "
            f"{list(_ATTENTION_KINDS)} (a single type for every layer, or a list with one per layer)")
    window = used.get("window_size")
    if "local" in kinds and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise SMPInvalidArgumentError(
            f"smp.nn.{where}(window_size={window!r}): local attention layers need window_size, a positive int "
            "(GPT-Neo's config.window_size, 256 for its released models)")


def check_attention_layers(where: str, options: Options, num_layers: int) -> None:
    """A per-layer ``attention_layers_type`` list names exactly ``num_layers`` layers."""
    kind = options.attention_layers_type
    if isinstance(kind, tuple) and len(kind) != num_layers:
        raise SMPInvalidArgumentError(
            f"smp.nn.{where}(attention_layers_type=[{len(kind)} entries]): one type per layer is needed, "
            f"num_layers={num_layers}")


def check_activation(where: str, activation: str) -> str:
    """SMP's ``activation`` ('gelu', 'relu'); 'gelu_new' (tanh approximation) is GPT-2's."""
    if activation not in ("gelu", "relu", "gelu_new"):
        raise SMPInvalidArgumentError(f"smp.nn.{where}(activation={activation!r}): supported are 'gelu', 'relu' "
                                      "and 'gelu_new' (the tanh approximation Hugging Face GPT-2 uses)")
    return activation


def check_layernorms(where: str, pre_layernorm: bool, post_layernorm: bool) -> None:
    """One of the two placements: SMP needs at least one; both at once is not implemented here."""
    if pre_layernorm == post_layernorm:
        raise SMPUnsupportedError(
            f"smp.nn.{where}(pre_layernorm={pre_layernorm}, post_layernorm={post_layernorm}): exactly one of "
            "pre_layernorm / post_layernorm must be True in smp2ds (both or neither is not supported)")


def check_no_cross_attention(where: str, value: bool) -> None:
    if value:
        raise SMPUnsupportedError(f"smp.nn.{where}: cross attention (add_cross_attention / cross_attention=True) "
                                  "is not implemented by smp2ds; supported: False")
