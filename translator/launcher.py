"""Launch commands and environment that reproduce a SageMaker SMP job on any machines.

SageMaker ran ``mpirun`` over hosts ``algo-1..algo-N`` and exported the job's settings as
``SM_*`` variables (smp-config.md section 6): ``SM_HP_MP_PARAMETERS`` is the compact JSON
(``sort_keys``, no spaces) of the SMP parameters, ``SM_FRAMEWORK_PARAMS`` the ``sagemaker_*``
framework keys. The plan gives the same job as deepspeed / torchrun / mpirun command lines (argv
lists, the script is the placeholder ``train.py``), a DeepSpeed hostfile and that environment.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any

SCRIPT_PLACEHOLDER = "train.py"
DEFAULT_MASTER_PORT = 29760
"""SMP's own fallback rendezvous port when neither ddp_port nor MASTER_PORT is set."""


def compact_json(value: Any) -> str:
    """JSON exactly as the SageMaker training toolkit writes ``SM_*`` values."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def hosts_for(nodes: int) -> list[str]:
    """SageMaker host names ``algo-1 .. algo-N``."""
    return [f"algo-{i + 1}" for i in range(nodes)]


def hyperparameter_args(hyperparameters: Mapping[str, Any]) -> list[str]:
    """Estimator hyperparameters as the script arguments SageMaker passes: ``--key value``.

    Keys in sorted order; a dict value becomes ``k1=v1,k2=v2`` (sorted), anything else its
    ``str()`` (so ``True`` stays ``True``), as SageMaker's training toolkit renders them.
    """
    args: list[str] = []
    for key in sorted(hyperparameters):
        value = hyperparameters[key]
        if isinstance(value, Mapping):
            value = ",".join(f"{k}={v}" for k, v in sorted(value.items()))
        args += [f"--{key}", str(value)]
    return args


def mp_parameters(given: Mapping[str, Any], pp: int, smp_version: int) -> dict[str, Any]:
    """The dict for ``SM_HP_MP_PARAMETERS``: the user's keys, plus ``partitions`` for SMP v1.

    Hugging Face's ``is_sagemaker_mp_enabled()`` looks for the literal key ``partitions``, and
    SMP accepts it next to ``pipeline_parallel_degree`` when both agree, so it is always added.
    """
    params = dict(given)
    if smp_version == 1 and "partitions" not in params:
        params["partitions"] = pp
    return params


def launcher_section(
    *,
    given: Mapping[str, Any],
    smp_version: int,
    strategy: str,
    world_size: int,
    ranks_per_node: int,
    nodes: int,
    pp: int,
    port: int | None,
    mpi: Mapping[str, Any],
    instance_type: str | None,
    hyperparameters: Mapping[str, Any],
    script: str = SCRIPT_PLACEHOLDER,
) -> dict[str, Any]:
    """The plan's ``launcher`` section."""
    hosts = hosts_for(nodes)
    master = hosts[0]
    master_port = port if port is not None else DEFAULT_MASTER_PORT
    custom = str(mpi.get("custom_mpi_options") or "")
    env = _environment(
        given=given,
        smp_version=smp_version,
        strategy=strategy,
        hosts=hosts,
        ranks_per_node=ranks_per_node,
        pp=pp,
        mpi=mpi,
        custom=custom,
        instance_type=instance_type,
        hyperparameters=hyperparameters,
    )
    script_argv = [script, *hyperparameter_args(hyperparameters)]
    deepspeed = ["deepspeed"]
    if nodes > 1:
        deepspeed += ["--hostfile", "hostfile", "--num_nodes", str(nodes), "--master_addr", master]
    # SMP scripts do not parse --local_rank; they read LOCAL_RANK from the environment.
    deepspeed += [
        "--num_gpus",
        str(ranks_per_node),
        "--master_port",
        str(master_port),
        "--no_local_rank",
        *script_argv,
    ]
    torchrun = [
        "torchrun",
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(ranks_per_node),
        # one command per host: each host passes its own index (0 on algo-1)
        "--node-rank",
        "${NODE_RANK}",
        "--master-addr",
        master,
        "--master-port",
        str(master_port),
        *script_argv,
    ]
    mpirun = [
        "mpirun",
        "--host",
        ",".join(f"{h}:{ranks_per_node}" for h in hosts),
        "-np",
        str(world_size),
        "--allow-run-as-root",
        "--tag-output",
        "-bind-to",
        "none",
        "-map-by",
        "slot",
        "-x",
        f"MASTER_ADDR={master}",
        "-x",
        f"MASTER_PORT={master_port}",
    ]
    for name in sorted(env):
        mpirun += ["-x", name]
    mpirun += shlex.split(custom)
    mpirun += ["python", *script_argv]
    return {
        "script": script,
        "hosts": hosts,
        "nodes": nodes,
        "ranks_per_node": ranks_per_node,
        "world_size": world_size,
        "master_addr": master,
        "master_port": master_port,
        "deepspeed": deepspeed,
        "torchrun": torchrun,
        "mpirun": mpirun,
        "hostfile": "".join(f"{h} slots={ranks_per_node}\n" for h in hosts),
        "env": env,
        "custom_mpi_options": custom,
    }


def _environment(
    *,
    given: Mapping[str, Any],
    smp_version: int,
    strategy: str,
    hosts: list[str],
    ranks_per_node: int,
    pp: int,
    mpi: Mapping[str, Any],
    custom: str,
    instance_type: str | None,
    hyperparameters: Mapping[str, Any],
) -> dict[str, str]:
    dataparallel = strategy == "dataparallel"
    smp_v1 = not dataparallel and smp_version == 1
    framework: dict[str, Any] = {
        "sagemaker_distributed_dataparallel_enabled": dataparallel,
        "sagemaker_mpi_custom_mpi_options": custom,
        # SMP v1 only ran under MPI (the SDK refused it otherwise); Hugging Face checks this flag.
        "sagemaker_mpi_enabled": True if smp_v1 else bool(mpi.get("enabled", False)),
        "sagemaker_mpi_num_of_processes_per_host": ranks_per_node,
    }
    if instance_type:
        framework["sagemaker_instance_type"] = instance_type
    hps: dict[str, Any] = dict(hyperparameters)
    if not dataparallel:
        hps["mp_parameters"] = mp_parameters(given, pp, smp_version)
    env = {
        "SM_FRAMEWORK_PARAMS": compact_json(framework),
        "SM_HOSTS": compact_json(hosts),
        "SM_CURRENT_HOST": hosts[0],
        "SM_NUM_GPUS": str(ranks_per_node),
        "SM_HPS": compact_json(hps),
        "SM_MODEL_DIR": "/opt/ml/model",
        "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data",
    }
    if instance_type:
        env["SM_CURRENT_INSTANCE_TYPE"] = instance_type
    for name, value in hps.items():
        # the toolkit's to_env_vars: strings verbatim, everything else as compact JSON
        env[f"SM_HP_{name.upper()}"] = value if isinstance(value, str) else compact_json(value)
    return env
