"""What ``--model`` names, as something the memory tracer can build on fake tensors.

Three spellings: a Hugging Face ``config.json``; a model directory holding one (weights are never
read); or ``module:function``, a function of the user's that builds the model. The function returns
the model, or ``(model, make_inputs)`` where ``make_inputs(batch, seq_len)`` returns the keyword
arguments of one forward call (a Hugging Face model's inputs are known without it).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

InputMaker = Callable[[int, int], dict[str, Any]]

BLOCK_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
"""The Hugging Face config keys that give a model's number of transformer blocks."""
PER_LAYER_PATTERNS = ("attention_types", "sliding_window_pattern", "block_types", "layers_block_type",
                      "hybrid_override_pattern")
"""Config keys that describe blocks unlike each other in a compact form (not a list per layer)."""


@dataclass(frozen=True)
class ModelSource:
    """A buildable model: ``build()`` returns the whole model (call it under fake mode)."""

    description: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[nn.Module, int, int], dict[str, Any]]
    hf_config: Mapping[str, Any] | None = None

    def parameter_count(self) -> int:
        """The whole model's parameters (built on the meta device: nothing allocated)."""
        with torch.device("meta"):
            model = self.build()
        return sum(p.numel() for p in model.parameters())

    @property
    def blocks(self) -> tuple[str, int] | None:
        """(config key, count) of the model's transformer blocks, when a Hugging Face config names them (a model
        built by the user's function is not rebuilt with another count)."""
        config = self.hf_config or {}
        if config.get("is_encoder_decoder", _encoder_decoder_by_default(config.get("model_type"))):
            return None  # two block stacks (T5, BART): traced whole
        if any(key in config for key in PER_LAYER_PATTERNS):
            return None  # a pattern of unlike blocks (GPT-Neo's global and local attention, ...)
        for key in BLOCK_COUNT_KEYS:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                unlike = [k for k, v in config.items() if isinstance(v, list) and len(v) == value
                          and len({json.dumps(item, sort_keys=True) for item in v}) > 1]
                return None if unlike else (key, value)  # per-layer settings that differ: blocks not alike
        return None

    def with_blocks(self, count: int) -> ModelSource:
        """The same model with ``count`` transformer blocks (the memory estimate traces a few blocks and scales:
        :mod:`.block_scaling`); ValueError for a source whose block count is not a config key."""
        found = self.blocks
        if found is None or self.hf_config is None:
            raise ValueError(f"{self.description}: no block count to change")
        config = {**self.hf_config, found[0]: count}
        for key, value in self.hf_config.items():  # per-layer settings (Qwen2's layer_types), all alike: cut too
            if isinstance(value, list) and len(value) == found[1]:
                config[key] = value[:count]
        return _from_hf_config(config, self.description.rsplit(" from ", 1)[-1])

    @property
    def default_seq_len(self) -> int | None:
        """The config's maximum positions, the sequence length when neither flag nor config gives one."""
        for key in ("max_position_embeddings", "n_positions", "n_ctx"):
            value = (self.hf_config or {}).get(key)
            if isinstance(value, int):
                return value
        return None


def _encoder_decoder_by_default(model_type: Any) -> bool:
    import transformers

    try:
        return bool(transformers.AutoConfig.for_model(str(model_type)).is_encoder_decoder)
    except ValueError:  # a model type transformers does not know: its model class decides (built whole)
        return True


def load_model_source(spec: str) -> ModelSource:
    """Parse ``--model``; ValueError with the reason when it names nothing usable."""
    if os.path.isdir(spec):
        path = os.path.join(spec, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{spec} is a directory without a config.json")
        return _from_hf_config(_read_json(path), path)
    if os.path.isfile(spec):
        return _from_hf_config(_read_json(spec), spec)
    if ":" in spec:
        return _from_function(spec)
    raise ValueError(f"{spec!r} is neither a config.json, a model directory nor module:function")


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        value = json.load(fh)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object (a Hugging Face config.json)")
    return value


def _from_hf_config(config: dict[str, Any], path: str) -> ModelSource:
    import transformers

    archs = list(config.get("architectures") or [])
    if not archs or "model_type" not in config:
        raise ValueError(f"{path}: the config needs \"model_type\" and \"architectures\" (as a Hugging Face "
                         "config.json has)")
    cls = getattr(transformers, archs[0], None)
    if cls is None:
        raise ValueError(f"{path}: transformers has no class {archs[0]!r}")
    fields = {k: v for k, v in config.items() if k != "model_type"}

    def build() -> nn.Module:
        return cls(transformers.AutoConfig.for_model(config["model_type"], **fields))

    return ModelSource(description=f"{archs[0]} from {path}", build=build, make_inputs=hf_inputs, hf_config=config)


def hf_inputs(model: nn.Module, batch: int, seq_len: int) -> dict[str, Any]:
    """One training call's inputs for a Hugging Face model, by its head (synthetic token ids)."""
    vocab = int(getattr(model.config, "vocab_size", 0) or 2)
    ids = torch.randint(0, vocab, (batch, seq_len))
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel", "ForMaskedLM")):
        return {"input_ids": ids, "labels": ids}
    if name.endswith("ForSequenceClassification"):
        return {"input_ids": ids, "labels": torch.zeros(batch, dtype=torch.long)}
    if name.endswith("ForQuestionAnswering"):
        return {"input_ids": ids, "start_positions": torch.zeros(batch, dtype=torch.long),
                "end_positions": torch.ones(batch, dtype=torch.long)}
    return {"input_ids": ids}


def _from_function(spec: str) -> ModelSource:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"--model {spec}: cannot load {attr!r} from module {module_name!r}: {err}") from None
    makers: dict[str, InputMaker] = {}

    def build() -> nn.Module:
        built = function()
        model, maker = built if isinstance(built, tuple) else (built, None)
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {spec}: the function returned {type(model).__name__}, not an nn.Module "
                             "(or a (model, make_inputs) pair)")
        if maker is not None:
            makers["inputs"] = maker
        return model

    def make_inputs(model: nn.Module, batch: int, seq_len: int) -> dict[str, Any]:
        if "inputs" in makers:
            return dict(makers["inputs"](batch, seq_len))
        if hasattr(model, "config"):
            return hf_inputs(model, batch, seq_len)
        raise ValueError(f"--model {spec}: return (model, make_inputs) so the estimate can call the model; "
                         "make_inputs(batch, seq_len) gives the keyword arguments of one forward call")

    return ModelSource(description=f"{spec}()", build=build, make_inputs=make_inputs)
