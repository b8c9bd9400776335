"""A consolidated checkpoint -> a Hugging Face model directory (``from_pretrained`` loads it).

The full state dict is built (:mod:`.consolidate`), translated from SMP's distributed-transformer
names to Hugging Face's where the checkpoint holds them (``smp.nn.huggingface``), loaded strictly
into the model class the config names, and written with ``save_pretrained``: safetensors shards,
their index and ``config.json``. The strict load is the check that every weight found its place.

The config comes from ``--config FILE`` (a Hugging Face ``config.json``), from ``--model-type``
with the sizes read from the tensors' shapes (the head count is not in any shape, so it is given
as ``--num-attention-heads``), or, with neither, from the checkpoint's user content when the script
saved its model's config there (SMP's examples save ``model_config``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch

from smp2ds.engine.checkpoint_tools import consolidate
from smp2ds.engine.checkpoint_tools.checkpoint_folder import CheckpointLayout
from smp2ds.engine.exceptions import SMPCheckpointError, SMPInvalidArgumentError, SMPUnsupportedError
from smp2ds.engine.nn.huggingface.families import CONFIGS_FROM_SHAPES, EXPORTS

SIZED_TYPES = tuple(CONFIGS_FROM_SHAPES)


def translator(model_type: str, heads: int) -> Callable[[dict], dict]:
    """SMP distributed-transformer names -> Hugging Face's, for ``model_type``."""
    if model_type not in EXPORTS:
        raise SMPUnsupportedError(f"the checkpoint holds SMP distributed-transformer names (seq_layers) and model "
                                  f"type {model_type!r} has no translator to Hugging Face names; allowed: "
                                  f"{', '.join(EXPORTS)}")
    export_to_hf = EXPORTS[model_type]
    return lambda sd: export_to_hf(sd, heads)


def sized_config(model_type: str, sd: dict[str, torch.Tensor], heads: int | None) -> dict[str, Any]:
    """A config dict for ``model_type`` with every size the (Hugging Face named) shapes tell."""
    if model_type not in CONFIGS_FROM_SHAPES:
        raise SMPInvalidArgumentError(f"--model-type {model_type!r} cannot be sized from the shapes; allowed: "
                                      f"{', '.join(SIZED_TYPES)} (other models: give --config FILE)")
    if heads is None:
        raise SMPInvalidArgumentError(f"--model-type {model_type} needs --num-attention-heads: the head count "
                                      "is in no tensor's shape")
    try:
        return CONFIGS_FROM_SHAPES[model_type](sd, heads)
    except KeyError as exc:
        raise SMPCheckpointError(f"--model-type {model_type}: the checkpoint has no tensor {exc.args[0]!r}; is it a "
                                 f"{model_type} model? (else give --config FILE)") from None


def read_config(path: str) -> dict[str, Any]:
    try:
        with open(path) as handle:
            cfg = json.load(handle)
    except (OSError, ValueError) as exc:
        raise SMPInvalidArgumentError(f"--config {path}: not a readable JSON file ({exc})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise SMPInvalidArgumentError(f"--config {path}: a Hugging Face config.json with a model_type is needed")
    return cfg


def check_model_args(config_file: str | None, model_type: str | None, saved: bool = True) -> None:
    """The Hugging Face export names its model by at most one of a config file and a model type; by neither only
    when the checkpoint saved its config (``saved``)."""
    if config_file is not None and model_type is not None:
        raise SMPInvalidArgumentError("give one of --config FILE and --model-type TYPE, not both")
    if config_file is None and model_type is None and not saved:
        raise SMPInvalidArgumentError("give one of --config FILE and --model-type TYPE: the checkpoint's user "
                                      "content holds no model_config (a Hugging Face config) to take instead")


_CONTENT_CONFIG_KEYS = ("model_config", "config", "hf_config")
"""Where scripts keep their model's Hugging Face config in the user content (SMP's examples: ``model_config``)."""


def saved_config(layout: CheckpointLayout) -> dict[str, Any] | None:
    """The Hugging Face config the checkpoint's user content holds (read without running code), or None."""
    from smp2ds.engine.core import safe_load  # start-up: only when no config was given

    path = layout.extras.get("user_content")
    if path is None:
        return None
    try:
        content = safe_load.load(path, user_content=True)
    except SMPCheckpointError:
        return None  # holds types the allowlist refuses: the user gives the config instead
    for key in _CONTENT_CONFIG_KEYS:
        found = content.get(key) if isinstance(content, dict) else None
        if hasattr(found, "to_dict") and getattr(found, "model_type", None):
            return found.to_dict()
        if isinstance(found, dict) and found.get("model_type"):
            return dict(found)
    return None


def export(layout: CheckpointLayout, out_dir: str, config_file: str | None = None, model_type: str | None = None,
           heads: int | None = None, max_shard_size: str = "5GB") -> list[str]:
    """Write ``out_dir`` for ``AutoModelForCausalLM.from_pretrained``; returns the files written. With neither
    ``config_file`` nor ``model_type`` the config saved in the user content is used."""
    import transformers as tf

    saved = saved_config(layout) if config_file is None and model_type is None else None
    check_model_args(config_file, model_type, saved is not None)
    reader = consolidate.ShardReader()
    entries = consolidate.checked_plan(layout, reader)
    sd = dict(consolidate.iter_tensors(entries, reader))
    cfg = read_config(config_file) if config_file else saved
    kind = cfg["model_type"] if cfg else model_type
    if any(".seq_layers." in k for k in sd):
        count = heads or (cfg or {}).get("num_attention_heads") or (cfg or {}).get("n_head")
        sd = translator(kind, int(count or 0))(sd)
    if cfg is None:
        cfg = sized_config(kind, sd, heads)
    config = tf.AutoConfig.for_model(**cfg)
    model = _model_class(config)(config)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied and not _is_tied(model, k)]
    if missing or unexpected:
        raise SMPCheckpointError(f"{layout.directory}: the weights do not fit {type(model).__name__} of this config: "
                                 f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    before = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    model.save_pretrained(out_dir, max_shard_size=max_shard_size, safe_serialization=True)
    return sorted(set(os.listdir(out_dir)) - before) or sorted(os.listdir(out_dir))


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    """``key`` shares its tensor with another parameter (a tied head): loading the other filled it."""
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(key)
    return target is not None and any(p is target for k, p in params.items() if k != key)


def _model_class(config: Any) -> Any:
    import transformers as tf

    for auto in (tf.AutoModelForCausalLM, tf.AutoModelForMaskedLM, tf.AutoModel):
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise SMPUnsupportedError(f"no Hugging Face model class for model type {config.model_type!r}")
