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
come, then each of their moments (:class:`.optimizer_state.StateSource`); with Hugging Face names, a unit (one
layer) at a time. Only the checks and Adam's step are read before the first file is written. The folder is written
under a temporary name and renamed into place.
"""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

import torch

from smp2ds.engine.checkpoint_tools import consolidate, hf_naming, optimizer_state
from smp2ds.engine.checkpoint_tools.checkpoint_folder import CheckpointLayout
from smp2ds.engine.checkpoint_tools.dcp_export import check_out_dir, staged_output
from smp2ds.engine.exceptions import SMPInvalidArgumentError, SMPUnsupportedError

PARAM = "param"
"""DeepSpeed's ``checkpoint.constants.PARAM``: the key of the tensor in each per-parameter file."""
MOMENTS = ("exp_avg", "exp_avg_sq")


def _step(source: optimizer_state.StateSource, directory: str) -> torch.Tensor:
    """The one Adam step all parameters share (DeepSpeed keeps one per parameter group)."""
    steps = {float(s["step"]) for s in source.scalars.values() if "step" in s}
    if len(steps) != 1:
        raise SMPUnsupportedError(f"{directory}: Adam steps {sorted(steps)} across parameters; DeepSpeed's universal "
                                  "format holds one step; allowed: Adam state with one common step")
    return torch.tensor(steps.pop(), dtype=torch.float32)


def _check(source: optimizer_state.StateSource, directory: str) -> None:
    for name, scalars in source.scalars.items():
        missing = [k for k in ("step", *MOMENTS) if k not in scalars and k not in source.moments[name]]
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
    source = optimizer_state.state_source(layout, entries, reader)
    _check(source, layout.directory)
    step = _step(source, layout.directory)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in source.param_groups]
    tag = (layout.tag or "smp2ds").replace(os.sep, "_")
    with staged_output(out_dir) as staging:
        zero = os.path.join(staging, tag, "zero")

        def write(key: str, what: str, tensor: torch.Tensor) -> None:
            _save({PARAM: tensor.to(torch.float32)}, os.path.join(zero, key, f"{what}.pt"))

        if translate is None:
            for key, tensor in consolidate.iter_tensors(entries, reader):
                write(key, "fp32", tensor)
                del tensor
                if source.moments.get(key):
                    for moment in MOMENTS:
                        write(key, moment, source.tensor(key, moment))
                        source.release()
                    _save(step.clone(), os.path.join(zero, key, "step.pt"))
        else:
            by_key = {e.key: e for e in entries}
            renaming = hf_naming.plan({e.key: (e.shape, e.dtype) for e in entries}, translate)
            translated = hf_naming.plan_state(renaming, source)  # refuses a parameter of two groups, before writing
            for index, unit in enumerate(renaming.units):
                weights = renaming.translate_unit(index, {k: consolidate.join(by_key[k], reader) for k in unit})
                reader.maybe_release(force=True)  # a unit's pieces are read once: the pages no output maps can go
                for key in list(weights):  # handed over one at a time: the unit shrinks as it is written
                    write(key, "fp32", weights.pop(key))
                for moment in MOMENTS:
                    moments = hf_naming.unit_moments(renaming, index, source, moment)
                    source.release(force=True)
                    for key in list(moments):
                        write(key, moment, moments.pop(key))
                for key in (k for k, unit_index in translated.unit_of.items() if unit_index == index):
                    _save(step.clone(), os.path.join(zero, key, "step.pt"))
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
