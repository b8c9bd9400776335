"""One estimator's job as a cluster scheduler needs it: nodes, processes per node, the script and its environment.

``convert --to slurm`` and ``--to kubernetes`` start the same job as ``convert --to torchrun``: torchrun on each
node, running the estimator's entry point with its hyperparameters (``--key value``), under the SageMaker
environment of the plan's ``launcher`` section (``SM_HP_MP_PARAMETERS``, ``SM_HPS``, ``SM_HP_*``,
``SM_FRAMEWORK_PARAMS``, the estimator's own variables), with SageMaker's paths mapped to the given folders
(``sagemaker_paths.map_paths``). This module takes those pieces from the torchrun launch (``launch_spec``), so
every target exports exactly the same variables; the schedulers only differ in how torchrun is started.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from smp2ds.translator.plan_types import LauncherSettings
from smp2ds.translator.tools.launch_script import launch_spec
from smp2ds.translator.tools.sagemaker_paths import map_paths

TORCHRUN_FLAGS = ("--nnodes", "--nproc-per-node", "--node-rank", "--master-addr", "--master-port")
"""The flags, each with one value, that the plan's torchrun command has before the script."""

EFA_PREFIXES = ("FI_", "RDMAV_FORK_SAFE")
"""Variables of AWS's Elastic Fabric Adapter (libfabric's ``FI_*``; ``RDMAV_FORK_SAFE`` for its verbs): SageMaker
estimators export them through ``custom_mpi_options``; off AWS ``FI_PROVIDER=efa`` makes NCCL's libfabric plugin
look for a device that is not there."""


def is_efa_variable(name: str) -> bool:
    return name.startswith(EFA_PREFIXES)


def cluster_job(launcher: LauncherSettings, entry_point: str | None, paths: Mapping[str, Any] | None,
                ddp_port: int | None, *, source_dir: str | None = None, efa: bool = False) -> dict[str, Any]:
    """The job: ``nodes``, ``nproc_per_node``, ``world_size``, ``hosts``, ``env`` (name -> value), ``script``
    (the argv after ``torchrun``: the entry point and its arguments), ``ddp_port`` (SMP's, or None),
    ``mapped_dirs`` (the local folders SageMaker's model, output data and checkpoint paths became),
    ``source_dir`` (the estimator's: SageMaker ran the entry point from it) and ``efa`` with ``left_out`` (the
    EFA variables dropped from ``env`` unless ``efa`` keeps them)."""
    spec = launch_spec(launcher, "torchrun", entry_point)
    env, command = spec["env"], spec["command"]
    mapped: list[str] = []
    if paths and (paths.get("output_dir") or paths.get("checkpoint_dir") or paths.get("channels")):
        env, command = map_paths(env, command, paths.get("output_dir"), paths.get("checkpoint_dir"),
                                 paths.get("channels") or {})
        if paths.get("output_dir"):
            mapped += [env["SM_MODEL_DIR"], env["SM_OUTPUT_DATA_DIR"]]
        if paths.get("checkpoint_dir"):
            mapped.append(str(paths["checkpoint_dir"]))
    left_out = [] if efa else sorted(name for name in env if is_efa_variable(name))
    env = {name: value for name, value in env.items() if name not in left_out}
    return {
        "source_dir": source_dir,
        "efa": efa,
        "left_out": left_out,
        "nodes": int(spec["nodes"]),
        "nproc_per_node": int(spec["nproc_per_node"]),
        "world_size": int(spec["world_size"]),
        "hosts": list(spec["hosts"]),
        "env": dict(env),
        "script": script_argv(command),
        "ddp_port": ddp_port,
        "mapped_dirs": mapped,
    }


def script_argv(torchrun: list[str]) -> list[str]:
    """The script and its arguments from the plan's torchrun command (``torchrun --nnodes N ... SCRIPT ARGS``)."""
    if not torchrun or torchrun[0] != "torchrun":
        raise ValueError(f"not a torchrun command: {torchrun[:1]}")
    at = 1
    while at < len(torchrun) and torchrun[at] in TORCHRUN_FLAGS:
        at += 2
    if at >= len(torchrun):
        raise ValueError("the torchrun command names no script")
    return list(torchrun[at:])


def free_of(port: int, taken: int | None) -> int:
    """``port``, or the next one when SMP's ``ddp_port`` already takes it: the engine's rank 0 hosts its own
    store on ``ddp_port``, so the launcher's rendezvous must listen elsewhere."""
    return port + 1 if taken == port else port
