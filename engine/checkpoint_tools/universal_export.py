"""A partial SMP checkpoint -> DeepSpeed's universal checkpoint (``"checkpoint": {"load_universal": true}``).

The layout is what DeepSpeed's ``checkpoint/ds_to_universal.py`` writes and what its loaders read
(``runtime/base_optimizer.py`` for ZeRO 1/2, ``runtime/zero/stage3.py`` for ZeRO-3; DeepSpeed 0.19)::

    OUT/latest_universal                         the tag (engine.load_checkpoint(OUT) reads it)
    OUT/<tag>/mp_rank_00_model_states.pt         engine counters, for ZeRO 1/2 loading
    OUT/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, for ZeRO-3 loading
    OUT/<tag>/zero/optimizer_state.pt            ds_version, param_groups (hyperparameters, no params),
                                                 optimizer_state_dict {state: {0: {step}}, param_groups}
    OUT/<tag>/zero/<parameter name>/fp32.pt      {"param": the full fp32 weight}
    OUT/<tag>/zero/<parameter name>/exp_avg.pt, exp_avg_sq.pt   {"param": the full Adam moment}
    OUT/<tag>/zero/<parameter name>/step.pt      Adam's step (a float32 0-d tensor, as torch keeps it)

Parameter names are the model's own (``named_parameters()``, a tied head under the name of the
tensor it shares, as DeepSpeed's ``param_names`` has it); a distributed-transformer checkpoint's are Hugging Face's
by default (:mod:`.hf_naming`), SMP's with ``--names smp``. Tensors without optimizer state (a tied
head's second name, buffers) get ``fp32.pt`` only, as ``ds_to_universal`` writes them. Each loading
rank cuts its own partition out of the full tensors, so any data-parallel size and ZeRO stage loads
it (stages 1 and 3 tested; tensor slicing for DeepSpeed's own tensor parallelism is not described).

Streaming: the model's tensors are joined one at a time (:mod:`.consolidate`) and written as they
come; the optimizer state is built first, whole, as ``consolidate --with-optimizer`` builds it.
The folder is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

import torch

from smp2ds.engine.checkpoint_tools import consolidate, hf_naming, optimizer_state
from smp2ds.engine.checkpoint_tools.dcp_export import check_out_dir, staged_output
from smp2ds.engine.checkpoint_tools.layout import CheckpointLayout
from smp2ds.engine.exceptions import SMPInvalidArgumentError, SMPUnsupportedError

PARAM = "param"
"""DeepSpeed's ``checkpoint.constants.PARAM``: the key of the tensor in each per-parameter file."""
MOMENTS = ("exp_avg", "exp_avg_sq")


def _step(optim: dict[str, Any], directory: str) -> torch.Tensor:
    """The one Adam step all parameters share (DeepSpeed keeps one per parameter group)."""
    steps = {float(s["step"]) for s in optim["state"].values() if "step" in s}
    if len(steps) != 1:
        raise SMPUnsupportedError(f"{directory}: Adam steps {sorted(steps)} across parameters; DeepSpeed's universal "
                                  "format holds one step; allowed: Adam state with one common step")
    return torch.tensor(steps.pop(), dtype=torch.float32)


def _check(optim: dict[str, Any], directory: str) -> None:
    for name, state in optim["state"].items():
        missing = [k for k in ("step", *MOMENTS) if k not in state]
        if missing:
            raise SMPUnsupportedError(f"{directory}: the optimizer state of {name} has no {', '.join(missing)}; "
                                      "the universal format holds Adam state (step, exp_avg, exp_avg_sq)")


def _save(obj: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(obj, path)


def export(layout: CheckpointLayout, out_dir: str, translate: hf_naming.Translate | None = None) -> list[str]:
    """Write the universal checkpoint ``out_dir``; returns the top-level entries written. ``translate``: the
    family's SMP -> Hugging Face translator; parameters then take Hugging Face's names (:mod:`.hf_naming`)."""
    check_out_dir(out_dir, "--to deepspeed-universal")
    if not layout.optimizer_files:
        raise SMPInvalidArgumentError(f"{layout.directory}: holds no optimizer state; --to deepspeed-universal writes "
                                      "DeepSpeed's universal checkpoint, which needs it (use --to dcp or hf for "
                                      "weights only)")
    reader = consolidate.ShardReader()
    entries = consolidate.checked_plan(layout, reader)
    optim = optimizer_state.consolidate_optimizer(layout, entries, reader)
    tensors = consolidate.iter_tensors(entries, reader)
    if translate is not None:
        by_key = {e.key: e for e in entries}
        renaming = hf_naming.plan({e.key: (e.shape, e.dtype) for e in entries}, translate)
        optim = hf_naming.translate_optimizer(renaming, optim)
        tensors = hf_naming.iter_translated(renaming, lambda k: consolidate.join(by_key[k], reader))
    _check(optim, layout.directory)
    step = _step(optim, layout.directory)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]]
    tag = (layout.tag or "smp2ds").replace(os.sep, "_")
    with staged_output(out_dir) as staging:
        zero = os.path.join(staging, tag, "zero")
        for key, tensor in tensors:
            folder = os.path.join(zero, key)
            _save({PARAM: tensor.to(torch.float32)}, os.path.join(folder, "fp32.pt"))
            state = optim["state"].get(key)
            if state is not None:
                for moment in MOMENTS:
                    _save({PARAM: state[moment].to(torch.float32)}, os.path.join(folder, f"{moment}.pt"))
                _save(step.clone(), os.path.join(folder, "step.pt"))
            del tensor
        version = metadata.version("deepspeed")
        _save({"ds_version": version, "param_groups": groups,
               "optimizer_state_dict": {"state": {0: {"step": step.clone()}}, "param_groups": groups}},
              os.path.join(zero, "optimizer_state.pt"))
        counters = {"dp_world_size": layout.rdp or 1, "mp_world_size": 1, "global_steps": int(step),
                    "skipped_steps": 0, "ds_version": version}
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            _save(counters, os.path.join(staging, tag, name))
        with open(os.path.join(staging, "latest_universal"), "w") as handle:
            handle.write(tag)
    return ["latest_universal", tag]
