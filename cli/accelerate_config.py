"""``smp2ds convert --to accelerate -o OUT.yaml``: an ``accelerate launch`` config that runs the plan's DeepSpeed JSON.

Two files are written: the plan's DeepSpeed config next to OUT (``OUT`` without ``.yaml`` /
``.yml``, plus ``.deepspeed.json``) and OUT itself, an accelerate config with
``distributed_type: DEEPSPEED`` whose ``deepspeed_config.deepspeed_config_file`` is that JSON's
absolute path. accelerate then takes ZeRO stage, gradient accumulation, clipping and precision
from the JSON, so the YAML names none of them (accelerate refuses a config that sets them twice).
Machines and processes come from the plan's launcher section (instance_count x processes per host).

Sharded data parallelism and tensor parallelism take FSDP2 instead (``distributed_type: FSDP``, ``fsdp_version:
2``) with accelerate's ``parallelism_config`` (accelerate >= 1.10): SMP's ``sharded_data_parallel_degree`` S over an
rdp of N ranks *is* FSDP2's 2-D mesh, ``dp_shard_size`` S inside ``dp_replicate_size`` N / S replicas (MiCS's
grouping, same ranks per group), and ``tensor_parallel_degree`` is ``tp_size`` for a model with a ``tp_plan`` (with
replicas but no sharded data parallelism the replicas become ``dp_shard``: accelerate composes tensor parallelism with
FSDP only; the file says so).
DeepSpeed's plugin cannot express either: its ZeRO-3 shards over the whole world. Only one file is written then.
Pipelines are refused by the caller, with the route that works.

The YAML is written by hand (scalars only, strings as JSON, which YAML reads the same), so
``convert`` does not import a YAML library on its start-up path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from smp2ds.translator.plan_types import Plan


def deepspeed_json_path(yaml_path: str) -> str:
    """Where the DeepSpeed JSON of ``yaml_path`` goes: ``run.yaml`` -> ``run.deepspeed.json``."""
    stem, ext = os.path.splitext(yaml_path)
    return (stem if ext.lower() in (".yaml", ".yml") else yaml_path) + ".deepspeed.json"


def _machines(plan: Plan) -> dict[str, Any]:
    """The keys every accelerate config of ``plan`` has: its machines, processes and rendezvous."""
    launcher = plan.launcher_settings
    machines: dict[str, Any] = {
        "machine_rank": 0,
        "main_process_port": launcher.master_port,
        "main_training_function": "main",
        "num_machines": launcher.nodes,
        "num_processes": launcher.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if launcher.nodes > 1:
        machines["main_process_ip"] = launcher.master_addr
    return machines


def accelerate_config(plan: Plan, deepspeed_json: str) -> dict[str, Any]:
    """The accelerate config (as a flat-ish dict) for ``plan``, pointing at ``deepspeed_json``."""
    stage = plan.engine_settings.zero_stage
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "deepspeed_config_file": os.path.abspath(deepspeed_json),
            # accelerate's own launcher per node (torchrun); "standard" needs no pdsh/ssh
            "deepspeed_multinode_launcher": "standard",
            # ZeRO-3 builds Hugging Face models already partitioned (deepspeed.zero.Init)
            "zero3_init_flag": stage == 3,
        },
        **_machines(plan),
    }


def to_yaml(mapping: Mapping[str, Any], indent: str = "") -> str:
    """Block YAML for nested mappings of scalars; strings are JSON-quoted (valid YAML)."""
    lines: list[str] = []
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            lines.append(f"{indent}{key}:")
            lines.append(to_yaml(value, indent + "  ").rstrip("\n"))
        elif isinstance(value, bool):
            lines.append(f"{indent}{key}: {'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            lines.append(f"{indent}{key}: {value}")
        else:
            lines.append(f"{indent}{key}: {json.dumps(str(value))}")
    return "\n".join(lines) + "\n"


def render_accelerate_yaml(plan: Plan, deepspeed_json: str, source: str) -> str:
    """The YAML text, with a header saying where it came from and how to use it."""
    header = (
        f"# accelerate config written by `smp2ds convert --to accelerate` from {source}\n"
        "# DeepSpeed settings (ZeRO stage, batch, accumulation, precision) live in "
        f"{os.path.basename(deepspeed_json)}\n"
        "# run: accelerate launch --config_file THIS_FILE your_script.py"
        + (" (on every machine, with --machine_rank set)\n" if plan.launcher_settings.nodes > 1 else "\n")
    )
    return header + to_yaml(accelerate_config(plan, deepspeed_json))


def fsdp2_sizes(plan: Plan) -> dict[str, int] | None:
    """accelerate's ``ParallelismConfig`` sizes for a plan with sharded data parallelism or tensor parallelism (the
    FSDP2 route), else None (DeepSpeed's plugin carries data parallelism and ZeRO-1 exactly)."""
    topo = plan.topology_settings
    sdp, tp = max(1, topo.sharded_data_parallel_degree), topo.tensor_parallel_degree
    if sdp == 1 and tp == 1:
        return None
    if sdp == 1:  # accelerate composes tensor parallelism with FSDP, not with replicas (DDP) alone
        return {"dp_replicate_size": 1, "dp_shard_size": topo.rdp_degree, "tp_size": tp, "cp_size": 1}
    return {"dp_replicate_size": topo.rdp_degree // sdp, "dp_shard_size": sdp, "tp_size": tp, "cp_size": 1}


_MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def fsdp2_config(plan: Plan) -> dict[str, Any]:
    """The accelerate config running FSDP2 on the plan's 2-D (or tensor-parallel) mesh."""
    sizes = fsdp2_sizes(plan)
    if sizes is None:
        raise ValueError("the plan needs no FSDP2 mesh: use accelerate_config")
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "fsdp_config": {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",  # one FSDP unit per transformer block
            "fsdp_reshard_after_forward": True,  # parameters sharded again after use: ZeRO-3, as SMP's sdp
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_offload_params": False,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_activation_checkpointing": False,  # SMP's scripts choose the modules: keep doing it in the script
        },
        "parallelism_config": {f"parallelism_config_{k}": v for k, v in sizes.items()},
        "mixed_precision": _MIXED.get(plan.engine_settings.precision.dtype, "no"),
        **_machines(plan),
    }


def render_fsdp2_yaml(plan: Plan, source: str) -> str:
    """The FSDP2 YAML text, with a header listing what differs from SMP and what the script must do."""
    sizes = fsdp2_sizes(plan) or {}
    topo = plan.topology_settings
    notes = [
        f"# accelerate config written by `smp2ds convert --to accelerate` from {source}: FSDP2 on accelerate's "
        "ParallelismConfig (accelerate >= 1.10)",
        f"# mesh: dp_replicate {sizes.get('dp_replicate_size')} x dp_shard {sizes.get('dp_shard_size')} x tp "
        f"{sizes.get('tp_size')} = {topo.world_size} ranks",
    ]
    if topo.sharded_data_parallel_degree > 1:
        notes.append(f"# sharded_data_parallel_degree {topo.sharded_data_parallel_degree}: parameters, gradients and "
                     "optimizer state sharded within groups of that many ranks, replicated across groups (as SMP)")
    if topo.tensor_parallel_degree > 1:
        notes.append("# tensor_parallel_degree -> tp_size: the model needs a tp_plan (Hugging Face LLaMA, Mistral, "
                     "Qwen2 ...); SMP's distributed transformer has none: `smp2ds checkpoint export --to hf` first")
        if topo.sharded_data_parallel_degree <= 1 and topo.rdp_degree > 1:
            notes.append(f"# differs from SMP: the {topo.rdp_degree} data-parallel replicas of each tensor-parallel "
                         "shard are FSDP2-sharded (dp_shard), because accelerate does not compose tensor parallelism "
                         "with plain replicas; the training is the same, the memory per rank lower")
    notes += [
        "# not in this file, set in your script / TrainingArguments: SMP's microbatches -> "
        "gradient_accumulation_steps; sdp_gradient_clipping -> max_grad_norm; activation checkpointing",
        "# run: accelerate launch --config_file THIS_FILE your_script.py"
        + (" (on every machine, with --machine_rank set)" if plan.launcher_settings.nodes > 1 else ""),
    ]
    return "\n".join(notes) + "\n" + to_yaml(fsdp2_config(plan))
