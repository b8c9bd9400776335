"""``smp2ds convert --to accelerate -o OUT.yaml``: an ``accelerate launch`` config that runs the plan's DeepSpeed JSON.

Two files are written: the plan's DeepSpeed config next to OUT (``OUT`` without ``.yaml`` /
``.yml``, plus ``.deepspeed.json``) and OUT itself, an accelerate config with
``distributed_type: DEEPSPEED`` whose ``deepspeed_config.deepspeed_config_file`` is that JSON's
absolute path. accelerate then takes ZeRO stage, gradient accumulation, clipping and precision
from the JSON, so the YAML names none of them (accelerate refuses a config that sets them twice).
Machines and processes come from the plan's launcher section (instance_count x processes per host).

The YAML is written by hand (scalars only, strings as JSON, which YAML reads the same), so
``convert`` does not import a YAML library on its start-up path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any


def deepspeed_json_path(yaml_path: str) -> str:
    """Where the DeepSpeed JSON of ``yaml_path`` goes: ``run.yaml`` -> ``run.deepspeed.json``."""
    stem, ext = os.path.splitext(yaml_path)
    return (stem if ext.lower() in (".yaml", ".yml") else yaml_path) + ".deepspeed.json"


def accelerate_config(plan: Any, deepspeed_json: str) -> dict[str, Any]:
    """The accelerate config (as a flat-ish dict) for ``plan``, pointing at ``deepspeed_json``."""
    launcher = plan.launcher
    nodes = int(launcher["nodes"])
    stage = int(plan.deepspeed.get("zero_optimization", {}).get("stage", 0))
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "deepspeed_config_file": os.path.abspath(deepspeed_json),
            # accelerate's own launcher per node (torchrun); "standard" needs no pdsh/ssh
            "deepspeed_multinode_launcher": "standard",
            # ZeRO-3 builds Hugging Face models already partitioned (deepspeed.zero.Init)
            "zero3_init_flag": stage == 3,
        },
        "machine_rank": 0,
        "main_process_port": int(launcher["master_port"]),
        "main_training_function": "main",
        "num_machines": nodes,
        "num_processes": int(launcher["world_size"]),
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if nodes > 1:
        config["main_process_ip"] = str(launcher["master_addr"])
    return config


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


def render_accelerate_yaml(plan: Any, deepspeed_json: str, source: str) -> str:
    """The YAML text, with a header saying where it came from and how to use it."""
    header = (
        f"# accelerate config written by `smp2ds convert --to accelerate` from {source}\n"
        "# DeepSpeed settings (ZeRO stage, batch, accumulation, precision) live in "
        f"{os.path.basename(deepspeed_json)}\n"
        "# run: accelerate launch --config_file THIS_FILE your_script.py"
        + (" (on every machine, with --machine_rank set)\n" if int(plan.launcher["nodes"]) > 1 else "\n")
    )
    return header + to_yaml(accelerate_config(plan, deepspeed_json))
