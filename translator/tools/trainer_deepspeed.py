"""The DeepSpeed JSON for a Hugging Face ``Trainer`` script (``convert --trainer``).

A ``Trainer`` given a DeepSpeed JSON (``TrainingArguments(deepspeed=...)`` or through ``accelerate launch``) fills
the values it owns where the JSON says ``"auto"`` and refuses a JSON whose value differs from its arguments
(transformers' ``HfTrainerDeepSpeedConfig``): the batch sizes (``per_device_train_batch_size`` x
``gradient_accumulation_steps`` x data-parallel size), the accumulation and the clipping (``max_grad_norm``, 1.0 by
default). A config carrying SMP's numbers there (SMP has no clipping key, so ``gradient_clipping`` 0.0) is refused by
every Trainer that clips. In Trainer mode those four keys are ``"auto"``; everything else stays the plan's.

Not ``"auto"`` for a plain script: accelerate turns an ``"auto"`` clipping into 1.0 there, a silent change.
Precision stays explicit as well: ``"auto"`` would let the Trainer's arguments decide it, and the Trainer refuses a
JSON whose ``fp16`` / ``bf16`` differ from ``--fp16`` / ``--bf16``, which names the flag the script must pass.

Pure: a config in, a config and notes out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TRAINER_FILLED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "gradient_clipping")
"""The keys the Trainer fills from its ``TrainingArguments`` when they read ``"auto"``."""


def trainer_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(``config`` with the Trainer's keys ``"auto"``, the notes saying what the script's arguments must be)."""
    out = {**config, **{key: "auto" for key in TRAINER_FILLED}}
    notes = [
        "Trainer mode: train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps and "
        "gradient_clipping are \"auto\", filled by the Trainer from per_device_train_batch_size, "
        "gradient_accumulation_steps and max_grad_norm",
        "keep per_device_train_batch_size at SMP's per-rank batch: SMP's micro-batches split that batch inside one "
        "step (the same gradient), so they are not gradient accumulation for the Trainer",
    ]
    clipping = config.get("gradient_clipping")
    if isinstance(clipping, (int, float)) and clipping > 0:
        notes.append(f"the job clipped gradients at {clipping} (sdp_gradient_clipping): pass --max_grad_norm "
                     f"{clipping}")
    precision = [name for name in ("fp16", "bf16")
                 if isinstance(config.get(name), Mapping) and config[name].get("enabled")]
    if precision:
        notes.append(f"{precision[0]} is on in this config: pass --{precision[0]} (TrainingArguments({precision[0]}="
                     "True)) or the Trainer refuses the config")
    return out, notes
