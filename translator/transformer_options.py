"""The fate of each setting SMP's distributed transformer takes, as the smp2ds engine implements it.

Scripts pass these to ``smp.model_creation(tensor_parallelism=True, ...)`` / ``smp.tensor_parallelism(...)``
(they reach the ``smp.nn.DistributedTransformer*`` modules that replace GPT-2, GPT-J, GPT-NeoX and
BERT/RoBERTa encoders) or to those constructors directly. They are script arguments, not configuration
keys: a refused value is refused when the model is built (``smp.DistributedModel`` or the ``smp.nn``
constructor raises, naming the setting). ``smp2ds explain`` lists them for configurations that set
``tensor_parallel_degree``. ``tests/cli/test_explain_transformer_options.py`` holds this table to the
engine (``engine/nn/transformer_options.py``, ``engine/nn/vocab_head.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

IMPLEMENTED, KERNEL, REFUSED, NO_EFFECT = "implemented", "kernel choice", "refused", "no effect"


@dataclass(frozen=True)
class OptionFate:
    option: str
    fate: str
    detail: str
    accepted: tuple = ()
    """For ``refused``: the values that are accepted (the 'off' values)."""


OPTIONS: tuple[OptionFate, ...] = (
    OptionFate("attention_in_fp32", IMPLEMENTED,
               "attention scores, mask and softmax computed in fp32 (probabilities cast back to the model's dtype); "
               "Hugging Face GPT-2's reorder_and_upcast_attn sets it"),
    OptionFate("fp32_residual_addition", IMPLEMENTED,
               "with an fp16/bf16 model the residual stream stays fp32 from the embeddings to the final layer "
               "norm: residual additions and the layer norms reading the stream in fp32, matmuls in the model's "
               "dtype (an fp16 stream past 65504 stays finite)"),
    OptionFate("query_key_layer_scaling", IMPLEMENTED,
               "as fp32 attention scores: Megatron divides the scores by the layer number and multiplies it back "
               "in an fp32 softmax, which is the same as computing them in fp32"),
    OptionFate("fused_softmax", KERNEL, "accepted with any value; PyTorch's softmax computes the same maths"),
    OptionFate("fused_dropout", KERNEL, "accepted with any value; PyTorch's dropout computes the same maths"),
    OptionFate("fused_bias_gelu", KERNEL,
               "accepted with any value; PyTorch's bias add and GELU compute the same maths"),
    OptionFate("use_alibi", REFUSED, "ALiBi attention biases are not implemented", (False, None)),
    OptionFate("attention_layers_type", IMPLEMENTED,
               "'global' or 'local' for every layer, or a list with one per layer (GPT-Neo's attention_layers): "
               "a local layer's causal mask keeps only the window_size most recent positions; a replaced "
               "GPTNeoForCausalLM passes its config's"),
    OptionFate("window_size", IMPLEMENTED, "the window of the local attention layers (needed when any layer is "
               "local)"),
    OptionFate("distribute_embedding", IMPLEMENTED,
               "DistributedTransformerLMHead at tensor_parallel_degree > 1: word embedding and head split over "
               "the vocabulary, loss by a vocab-parallel cross-entropy (full logits never joined; the forward "
               "with labels returns (loss, None)); nothing to split at tp 1; refused when the vocabulary is not "
               "divisible by tp, with pipeline_parallel_degree > 1, and by modules without an embedding "
               "(DistributedTransformer: BERT/RoBERTa encoders)"),
    OptionFate("flash_attention", IMPLEMENTED,
               "attention by PyTorch's scaled_dot_product_attention (FlashAttention / memory-efficient kernels on "
               "GPUs: no [N, heads, S, S] scores kept for backward), with every attention setting of the eager "
               "path; equal to it within rounding"),
    OptionFate("triton_flash_attention", IMPLEMENTED, "the same scaled_dot_product_attention path as "
               "flash_attention (SMP's Triton kernel served ALiBi, which is refused)"),
    OptionFate("use_normal_initialization", NO_EFFECT,
               "fresh weights are drawn from N(0, initializer_range) whatever its value; replaced Hugging Face "
               "models keep the weights Hugging Face initialised or loaded, and draw fresh ones where the script "
               "skipped Hugging Face's init"),
)


def option_rows() -> list[list[str]]:
    """``[option, fate, detail]`` per setting (refused ones name the accepted values)."""
    rows = []
    for o in OPTIONS:
        detail = o.detail
        if o.fate == REFUSED:
            detail += f"; accepted: {', '.join(repr(v) for v in o.accepted)}"
        rows.append([o.option, o.fate, detail])
    return rows


def options_json() -> list[dict[str, object]]:
    """The table as JSON objects (``accepted`` only for refused settings)."""
    return [{"option": o.option, "fate": o.fate, "detail": o.detail,
             **({"accepted": list(o.accepted)} if o.fate == REFUSED else {})} for o in OPTIONS]
