"""T5 and Flan-T5 (``T5ForConditionalGeneration``) as pipeline layers: encoder stages, then decoder stages.

Layers: ``encoder.embed_tokens`` -> ``encoder.dropout`` -> per encoder block, its relative position bias,
then the block -> ``encoder.final_layer_norm`` (+ dropout) -> ``decoder.embed_tokens`` -> ``decoder.dropout``
-> per decoder block, its relative position bias, then the block -> ``decoder.final_layer_norm`` (+ dropout,
+ the ``d_model ** -0.5`` scaling of the original T5) -> ``lm_head``.

Tensors between stages: ``(hidden, attention_mask, decoder_input_ids, decoder_attention_mask)`` through the
encoder and ``(hidden, encoder_output, attention_mask, decoder_attention_mask)`` through the decoder, the masks
and ids as integers. The encoder output travels with the decoder's hidden states so every decoder block can
attend to it, and its gradient flows back to the encoder stages; the last decoder block drops it (no later
layer uses it, and a float crossing a stage boundary must get a gradient). Each block builds its attention
masks from the integer masks as ``T5Stack.forward`` does once per call.

Relative position bias: ``T5Stack.forward`` lets its first block compute the bias from that block's
``relative_attention_bias`` embedding and hands it to every later block. Here a layer in front of each block
computes it with the first block's own ``compute_bias``; those layers are `TiedLayerSpec` entries with one key
per stack, so every stage running blocks of a stack holds the embedding and DeepSpeed all-reduces its gradient
between those stages. The first block is held without that embedding (its bias comes from its layer like the
others'). The bias is a float tensor that depends on the embedding: when a stage boundary falls between a bias
layer and its block, the bias crosses it with its gradient.

Embeddings: the encoder's and the decoder's token embeddings (and ``lm_head`` when its weight is the same,
the default: transformers 5.x always ties it, 4.57 ties it unless ``tie_word_embeddings=False``) are
`TiedLayerSpec` entries with one key, like GPT-2's ``wte``/``lm_head``. Whether the decoder output is scaled
by ``d_model ** -0.5`` follows the model's forward: ``config.scale_decoder_outputs`` on 5.x,
``config.tie_word_embeddings`` on 4.57 (Flan-T5 / T5 v1.1 configs say ``tie_word_embeddings: false``: no scaling).

The call: ``model(input_ids, attention_mask=..., labels=...)`` (the decoder input is ``labels`` shifted right
by the model's own ``_shift_right``) or with ``decoder_input_ids`` / ``decoder_attention_mask``; the loss is
the model's cross entropy over ``labels`` ignoring -100. Before training the layer list is run against the
model's own forward on a small padded batch (`check_equivalent`); a model it does not reproduce is refused.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from smp2ds.engine.integrations.transformers_compat import is_transformers_5, layer_hidden, legacy_causal_mask
from smp2ds.engine.pipeline.families.hf_common import _mask_call, bind_call, causal_mask, check_call, finish, long_mask
from smp2ds.engine.pipeline.families.probe import PROBE_SHAPE, probe_batch, run_layers
from smp2ds.engine.pipeline.layers import LayerList, PipeLayer, UnsupportedModelError, tied

FAMILY = "transformers T5ForConditionalGeneration"
SUPPORTED_ARGS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels")


def matches(model: nn.Module) -> bool:
    return (type(model).__name__ == "T5ForConditionalGeneration" and hasattr(model, "encoder")
            and hasattr(model, "decoder") and hasattr(model, "lm_head"))


# ---- what T5Stack.forward builds once before its block loop ---------------------------------------------
class StackInputs:
    """The attention masks one ``T5Stack`` builds from the 2-D padding masks, per installed transformers.

    A plain helper object (not a submodule): the stack itself is not part of any stage.
    """

    def __init__(self, stack: nn.Module):
        self.stack = stack
        self.config = stack.config
        self.is_decoder = bool(stack.is_decoder)

    def self_mask(self, hidden: torch.Tensor, mask: torch.Tensor) -> Any:
        """The self-attention mask: bidirectional (encoder) or causal (decoder)."""
        if is_transformers_5():
            if self.is_decoder:
                return causal_mask(self.config, hidden, mask)
            from transformers.masking_utils import create_bidirectional_mask

            return _mask_call(create_bidirectional_mask, self.config, hidden, mask)
        if self.is_decoder:  # 4.x: what the stack's own forward builds, no cache
            return legacy_causal_mask(self.stack, self.config, hidden, mask)
        extended = mask[:, None, None, :].to(dtype=hidden.dtype)
        return (1.0 - extended) * torch.finfo(hidden.dtype).min

    def cross_mask(self, hidden: torch.Tensor, encoder_out: torch.Tensor, encoder_mask: torch.Tensor) -> Any:
        """The decoder's mask over the encoder positions."""
        if is_transformers_5():
            from transformers.masking_utils import create_bidirectional_mask

            return _mask_call(create_bidirectional_mask, self.config, hidden, encoder_mask,
                              encoder_hidden_states=encoder_out)
        return self.stack.invert_attention_mask(encoder_mask)

    def block_bias(self, bias: torch.Tensor, mask: Any) -> torch.Tensor:
        """The self-attention bias a block receives: on 4.57 the first block adds the mask into it (and the
        later blocks get that sum); on 5.x the mask is applied separately."""
        if is_transformers_5() or mask is None:
            return bias
        return bias + mask[:, :, :, : bias.shape[-1]]


def position_bias(attention: nn.Module, shared: nn.Module, inputs: tuple) -> tuple:
    """The relative position bias of a stack (its first block's ``compute_bias``), appended to the inputs.

    ``shared`` is the tied ``relative_attention_bias`` embedding of this stage; ``attention`` (the first
    block's self-attention) is bound with `functools.partial` and computes with that same embedding.
    """
    hidden = inputs[0]
    assert shared.module is attention.relative_attention_bias
    length = hidden.shape[1]
    return (*inputs, attention.compute_bias(length, length, device=hidden.device))


def _without(module: nn.Module, skip: nn.Module) -> list[nn.Module]:
    """Submodules of ``module`` covering all its parameters except ``skip``'s."""
    if not any(m is skip for m in module.modules()):
        return [module]
    if any(t is not None for t in (*module._parameters.values(), *module._buffers.values())):
        raise UnsupportedModelError(f"{type(module).__name__} holds tensors next to its relative attention bias")
    return [held for child in module.children() if child is not skip for held in _without(child, skip)]


class Block(nn.Module):
    """One ``T5Block``, called as ``T5Stack.forward`` calls it, with the position bias of its bias layer.

    The first block of a stack is held without its ``relative_attention_bias`` (the bias layers hold that);
    the block itself is then called through a plain reference, and `train` reaches it.
    """

    def __init__(self, block: nn.Module, inputs: StackInputs, skip: nn.Module | None, last: bool):
        super().__init__()
        if skip is None:
            self.block = block
        else:
            self.parts = nn.ModuleList(_without(block, skip))
        self._call = [block]  # a list: not registered as a submodule
        self.inputs = inputs  # a plain helper object, not a submodule
        self.last = last
        self.cache_position = "cache_position" in inspect.signature(type(block).forward).parameters

    def train(self, mode: bool = True) -> Block:
        super().train(mode)
        self._call[0].train(mode)
        return self

    def forward(self, inputs: tuple) -> Any:
        if self.inputs.is_decoder:
            hidden, encoder_out, encoder_mask, mask, bias = inputs
        else:
            hidden, mask, decoder_ids, decoder_mask, bias = inputs
        self_mask = self.inputs.self_mask(hidden, mask)
        kwargs: dict[str, Any] = {"attention_mask": self_mask,
                                  "position_bias": self.inputs.block_bias(bias, self_mask)}
        if self.inputs.is_decoder:
            kwargs["encoder_hidden_states"] = encoder_out
            kwargs["encoder_attention_mask"] = self.inputs.cross_mask(hidden, encoder_out, encoder_mask)
        if self.cache_position:  # 4.57 computes the cross-attention bias from it
            kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
        out = layer_hidden(self._call[0](hidden, **kwargs))
        if self.inputs.is_decoder:
            return out if self.last else (out, encoder_out, encoder_mask, mask)
        return out, mask, decoder_ids, decoder_mask


# ---- embeddings, norms, head --------------------------------------------------------------------------
def _encoder_lookup(shared: nn.Module, inputs: tuple) -> tuple:
    input_ids, *rest = inputs
    return (shared.module(input_ids), *rest)


def _decoder_lookup(shared: nn.Module, inputs: tuple) -> tuple:
    encoder_out, mask, decoder_ids, decoder_mask = inputs
    return shared.module(decoder_ids), encoder_out, mask, decoder_mask


def _head(shared: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, shared.module.weight)


class Plain(nn.Module):
    """An untied embedding or head as a layer (``forward_fn`` receives this wrapper as ``shared``)."""

    def __init__(self, module: nn.Module, forward_fn: Any):
        super().__init__()
        self.module = module
        self.forward_fn = forward_fn

    def forward(self, inputs: Any) -> Any:
        return self.forward_fn(self, inputs)


class Dropout(nn.Module):
    """A stack's dropout on its token embeddings."""

    def __init__(self, dropout: nn.Module):
        super().__init__()
        self.dropout = dropout

    def forward(self, inputs: tuple) -> tuple:
        return (self.dropout(inputs[0]), *inputs[1:])


class FinalNorm(nn.Module):
    """A stack's ``final_layer_norm`` then its dropout; the decoder's output optionally scaled by d_model**-0.5."""

    def __init__(self, norm: nn.Module, dropout: nn.Module, scale: float | None = None):
        super().__init__()
        self.norm, self.dropout, self.scale = norm, dropout, scale

    def forward(self, inputs: Any) -> Any:
        if isinstance(inputs, tuple):  # encoder: the decoder's inputs pass through
            return (self.dropout(self.norm(inputs[0])), *inputs[1:])
        hidden = self.dropout(self.norm(inputs))
        return hidden if self.scale is None else hidden * self.scale


# ---- the call ---------------------------------------------------------------------------------------------
class T5Adapter:
    """``model(input_ids, attention_mask=..., labels=... | decoder_input_ids=...)`` <-> pipeline tensors."""

    def __init__(self, model: nn.Module):
        self.model = model

    def pipe_inputs(self, args: tuple, kwargs: dict) -> tuple:
        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        ids = bound["input_ids"]
        decoder_ids = bound.get("decoder_input_ids")
        if decoder_ids is None:
            labels = bound.get("labels")
            if labels is None:
                raise UnsupportedModelError(f"pipelined {type(self.model).__name__} needs labels or decoder_input_ids")
            decoder_ids = self.model._shift_right(labels)
        return (ids, long_mask(bound.get("attention_mask"), ids), decoder_ids,
                long_mask(bound.get("decoder_attention_mask"), decoder_ids))

    def make_output(self, logits: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        from transformers.modeling_outputs import Seq2SeqLMOutput

        bound = bind_call(self.model, args, kwargs)
        check_call(self.model, bound, SUPPORTED_ARGS)
        labels = bound.get("labels")
        loss = None
        if labels is not None:  # as T5ForConditionalGeneration.forward
            labels = labels.to(logits.device)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        return finish(Seq2SeqLMOutput(loss=loss, logits=logits), bound, self.model.config)


# ---- the layer list ---------------------------------------------------------------------------------------
def _scale(model: nn.Module) -> float | None:
    """``d_model ** -0.5`` when the model's forward scales the decoder output (original T5), else None."""
    config = model.config
    scaled = config.scale_decoder_outputs if hasattr(config, "scale_decoder_outputs") else config.tie_word_embeddings
    return model.model_dim ** -0.5 if scaled else None


def _stack_layers(prefix: str, stack: nn.Module) -> list[PipeLayer]:
    inputs = StackInputs(stack)
    first = stack.block[0].layer[0].SelfAttention
    rel = first.relative_attention_bias
    key = f"t5_{prefix}_relative_attention_bias"
    layers = []
    for i, block in enumerate(stack.block):
        layers.append(PipeLayer(name=f"{prefix}.block.{i}.position_bias",
                                entry=tied(key, rel, partial(position_bias, first)), modules=(rel,), owners=(block,),
                                compute=0.0))
        wrapper = Block(block, inputs, rel if i == 0 else None, last=stack.is_decoder and i == len(stack.block) - 1)
        held = tuple(wrapper.parts) if i == 0 else (block,)
        layers.append(PipeLayer(name=f"{prefix}.block.{i}", entry=wrapper, modules=held, owners=(block,)))
    return layers


def layer_list(model: nn.Module) -> LayerList:
    """The T5 layer list, without the check against the model's forward."""
    encoder, decoder, head = model.encoder, model.decoder, model.lm_head
    if not len(encoder.block) or not len(decoder.block):
        raise UnsupportedModelError(f"{type(model).__name__} without encoder or decoder blocks")
    for stack in (encoder, decoder):
        if not getattr(stack.block[0].layer[0].SelfAttention, "has_relative_attention_bias", False):
            raise UnsupportedModelError("its first block of a stack has no relative attention bias")
    enc_emb, dec_emb = encoder.embed_tokens, decoder.embed_tokens
    key = "t5_shared"
    tied_dec = dec_emb.weight is enc_emb.weight
    tied_head = head.weight is enc_emb.weight
    if not tied_dec and head.weight is dec_emb.weight:
        raise UnsupportedModelError("its lm_head shares the decoder's embedding but not the encoder's")

    def embedding(module: nn.Module, fn: Any, share: bool) -> Any:
        return tied(key, enc_emb, fn) if share else Plain(module, fn)

    # 4.57 puts model.shared itself in both stacks: its manual placement then follows the stack
    enc_owner, dec_owner = (encoder, decoder) if enc_emb is dec_emb else (enc_emb, dec_emb)
    layers = [PipeLayer(name="encoder.embed_tokens", entry=embedding(enc_emb, _encoder_lookup, tied_dec or tied_head),
                        modules=(enc_emb,), owners=(enc_owner,)),
              PipeLayer(name="encoder.dropout", entry=Dropout(encoder.dropout), modules=(encoder.dropout,),
                        owners=(enc_owner,))]
    layers += _stack_layers("encoder", encoder)
    layers.append(PipeLayer(name="encoder.final_layer_norm",
                            entry=FinalNorm(encoder.final_layer_norm, encoder.dropout),
                            modules=(encoder.final_layer_norm,), owners=(encoder.final_layer_norm,)))
    layers.append(PipeLayer(name="decoder.embed_tokens", entry=embedding(dec_emb, _decoder_lookup, tied_dec),
                            modules=(enc_emb if tied_dec else dec_emb,), owners=(dec_owner,)))
    layers.append(PipeLayer(name="decoder.dropout", entry=Dropout(decoder.dropout), modules=(decoder.dropout,),
                            owners=(dec_owner,)))
    layers += _stack_layers("decoder", decoder)
    layers.append(PipeLayer(name="decoder.final_layer_norm",
                            entry=FinalNorm(decoder.final_layer_norm, decoder.dropout, _scale(model)),
                            modules=(decoder.final_layer_norm,), owners=(decoder.final_layer_norm,)))
    layers.append(PipeLayer(name="lm_head", entry=tied(key, enc_emb, _head) if tied_head else Plain(head, _head),
                            modules=(enc_emb if tied_head else head,), owners=(head,),
                            compute=2.0 * head.weight.numel()))
    return LayerList(family="T5ForConditionalGeneration", layers=tuple(layers), adapter=T5Adapter(model),
                     model=model)


def check_equivalent(model: nn.Module, built: LayerList) -> None:
    """Refuse the model unless the layer list's logits equal its own forward's on a small padded batch
    (labels = the probe tokens, so the decoder runs on them shifted right); no values (meta, fake): no check."""
    tensors = list(model.parameters()) + list(model.buffers())
    if not tensors or any(t.is_meta or is_fake(t) for t in tensors):
        return
    ids, mask = probe_batch(model, tensors[0].device)
    call = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            expected = model(**call, use_cache=False).logits
            got = run_layers(built, built.adapter.pipe_inputs((), call))
    except Exception as exc:  # noqa: BLE001 - a failure is the reason for refusing
        raise UnsupportedModelError(
            f"pipeline parallelism cannot split a {type(model).__module__}.{type(model).__name__}: its T5 layer "
            f"list fails on a {PROBE_SHAPE} probe batch ({type(exc).__name__}: {exc})") from exc
    finally:
        for module, training in modes.items():
            module.training = training
    scale = max(1.0, float(expected.abs().max()))
    tol = (1e-4 if expected.dtype in (torch.float32, torch.float64) else 2e-2) * scale
    diff = float((got.float() - expected.float()).abs().max()) if got.shape == expected.shape else float("inf")
    if not diff <= tol:
        raise UnsupportedModelError(
            f"pipeline parallelism cannot split a {type(model).__module__}.{type(model).__name__}: on a probe batch "
            f"its T5 layer list's logits differ from its forward's by up to {diff:.3g} (tolerance {tol:.3g})")


def build(model: nn.Module) -> LayerList:
    built = layer_list(model)
    check_equivalent(model, built)
    return built
