"""Check a structural layer list against the model's own forward before training starts.

The structure (embedding, blocks, final norm, head) is found from the module tree, which cannot
show what a model's ``forward`` does between those parts (a scale on the embeddings, a cap on
the logits, masks of its own). So the layer list and ``model(input_ids, attention_mask)`` both
run on one small padded batch (2 x 8 tokens, eval mode, no gradients, no random numbers drawn)
and must give the same logits; otherwise the model is refused with the difference. A model on
PyTorch's meta device (``smp2ds explain`` sizes models without weights) cannot run and is not
probed: nothing trains on it. A model sharded for tensor parallelism (sharding comes before the
cut) is probed as it is: every rank of its group runs the probe at the same point, so the
sharded blocks' collectives pair up.
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.pipe import TiedLayerSpec
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from smp2ds.engine.pipeline.families.decoder_structure import NotADecoder
from smp2ds.engine.pipeline.layers import LayerList

PROBE_SHAPE = (2, 8)
"""Rows x tokens of the probe batch; the second row ends in two padding positions."""


def probe_batch(model: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic token ids (no RNG drawn, so training's random stream is untouched) and a padding mask."""
    rows, seq = PROBE_SHAPE
    seq = min(seq, getattr(model.config, "max_position_embeddings", seq) or seq)
    vocab = model.config.vocab_size
    ids = (torch.arange(rows * seq, device=device) * 7 % vocab).view(rows, seq)
    mask = torch.ones(rows, seq, dtype=torch.long, device=device)
    mask[1, -2:] = 0
    return ids, mask


def run_layers(layer_list: LayerList, x: Any) -> Any:
    """Every layer in order in this process, building each tied module once, as `PipelineModule` does."""
    built: dict[str, nn.Module] = {}
    for layer in layer_list.layers:
        if isinstance(layer.entry, TiedLayerSpec):
            if layer.entry.key not in built:  # built once: the tied module is shared by both ends
                built[layer.entry.key] = layer.entry.build()
            x = layer.entry.forward_fn(built[layer.entry.key], x)
        else:
            x = layer.entry(x)
    return x


def check_equivalent(model: nn.Module, layer_list: LayerList) -> None:
    """`NotADecoder` unless the layer list's logits equal ``model(...)``'s on the probe batch."""
    tensors = list(model.parameters()) + list(model.buffers())
    if not tensors or any(t.is_meta or is_fake(t) for t in tensors):
        return  # nothing to compare: no values (meta), or values the memory estimate only pretends (fake)
    device = tensors[0].device
    ids, mask = probe_batch(model, device)
    modes = {m: m.training for m in model.modules()}
    model.eval()  # dropout off: both runs must be deterministic
    try:
        with torch.no_grad():
            try:
                expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            except Exception as exc:  # noqa: BLE001 - any failure of the model's own forward is a reason
                raise NotADecoder(f"its own forward fails on a {PROBE_SHAPE} probe batch ({exc})") from exc
            try:
                got = run_layers(layer_list, layer_list.adapter.pipe_inputs((), {"input_ids": ids,
                                                                                  "attention_mask": mask}))
            except Exception as exc:  # noqa: BLE001 - a block that cannot be called this way is a reason
                raise NotADecoder(f"its blocks fail when called as embeddings -> blocks -> norm -> head "
                                  f"({type(exc).__name__}: {exc})") from exc
    finally:
        for module, training in modes.items():
            module.training = training
    _compare(expected, got)


def _compare(expected: torch.Tensor, got: torch.Tensor) -> None:
    if got.shape != expected.shape:
        raise NotADecoder(f"embeddings -> blocks -> norm -> head gives logits of shape {tuple(got.shape)}, its "
                          f"forward {tuple(expected.shape)}")
    scale = max(1.0, float(expected.abs().max()))
    # The same operations run in both (only their grouping into layers differs): agreement is
    # exact up to kernels choosing another path (e.g. SDPA's is_causal shortcut).
    tol = (1e-4 if expected.dtype in (torch.float32, torch.float64) else 2e-2) * scale
    diff = float((got.float() - expected.float()).abs().max())
    if not diff <= tol:
        raise NotADecoder(f"on a probe batch its logits differ from embeddings -> blocks -> norm -> head by up to "
                          f"{diff:.3g} (tolerance {tol:.3g}): its forward does more between those parts than the "
                          "module tree shows")
