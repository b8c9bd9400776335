"""Launcher environment and command lines: the one builder of a SageMaker job's ``SM_*`` variables.

SageMaker ran ``mpirun`` over hosts ``algo-1..algo-N`` and exported the job's settings as
``SM_*`` variables (docs/smp-semantics.md#launch-environment): ``SM_HP_MP_PARAMETERS`` is the compact JSON
(``sort_keys``, no spaces) of the SMP parameters, ``SM_FRAMEWORK_PARAMS`` the ``sagemaker_*``
framework keys. Two users build on the same pieces here:

* the plan's ``launcher`` section (``launcher_section``): the whole job as deepspeed / torchrun /
  mpirun command lines (argv lists, the script is the placeholder ``train.py``), a DeepSpeed
  hostfile and that environment;
* ``smp2ds launch`` (``local_environment``, ``launcher_command``): the plan's environment completed
  with what describes *this* machine and launch, and the command line that runs the real script.

Pure: what the machine has (its environment variables, CPU count, launcher executables, the
Python to run) is passed in by the caller; nothing is probed here and nothing imports torch.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

LAUNCHERS: tuple[str, ...] = ("deepspeed", "torchrun", "mpirun")
"""The launchers ``launcher_command`` builds command lines for."""
SCRIPT_PLACEHOLDER = "train.py"
DEFAULT_MASTER_PORT = 29760
"""SMP's own fallback rendezvous port when neither ddp_port nor MASTER_PORT is set."""


def compact_json(value: Any) -> str:
    """JSON exactly as the SageMaker training toolkit writes ``SM_*`` values."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def env_value(value: Any) -> str:
    """An ``SM_*`` value as the toolkit's ``to_env_vars`` writes it: strings verbatim, else compact JSON."""
    return value if isinstance(value, str) else compact_json(value)


def hosts_for(nodes: int) -> list[str]:
    """SageMaker host names ``algo-1 .. algo-N``."""
    return [f"algo-{i + 1}" for i in range(nodes)]


def hostfile_text(hosts: Sequence[str], slots: int) -> str:
    """A DeepSpeed hostfile: one ``host slots=N`` line per host."""
    return "".join(f"{h} slots={slots}\n" for h in hosts)


def shell_name(name: str) -> bool:
    """Whether a shell can ``export`` ``name`` (a hyperparameter named ``checkpoint-dir`` becomes
    ``SM_HP_CHECKPOINT-DIR``, which SageMaker sets through the process environment but no shell can)."""
    return bool(name) and (name[0].isalpha() or name[0] == "_") and all(c.isalnum() or c == "_" for c in name)


def deepspeed_env_text(env: Mapping[str, str]) -> str:
    """A ``.deepspeed_env`` file carrying ``env`` to every node of a multi-node deepspeed launch.

    The deepspeed launcher reads ``NAME=value`` lines from ``./.deepspeed_env`` and, over pdsh,
    runs ``export NAME=value`` on each node, wrapping a value in double quotes when it holds
    anything beyond ``[\\w@%+=:,./-]``. JSON values (``SM_HPS``, ``SM_HP_MP_PARAMETERS``) contain
    double quotes, so the characters a double-quoted shell word treats specially (backslash,
    double quote, ``$`` and backquote) are escaped here; the shell removes the escapes again. Names a
    shell cannot export (:func:`shell_name`) are left out: DeepSpeed's ``export`` of one would stop the node.
    """
    lines = []
    for name, value in env.items():
        if not shell_name(name):
            continue  # the remote `export` would abort the node's shell; the script passes it through env
        if "\n" in str(value):  # the file is read line by line: a newline would cut the value
            raise ValueError(f"{name}: a value with a newline cannot travel in .deepspeed_env")
        escaped = "".join("\\" + c if c in '\\"$`' else c for c in str(value))
        lines.append(f"{name}={escaped}\n")
    return "".join(lines)


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


def with_hyperparameters(script: Sequence[str], hyperparameters: Mapping[str, Any]) -> list[str]:
    """``script`` (``[path, args...]`` or ``["-m", module, args...]``) with the hyperparameters'
    ``--key value`` right after the entry point: as on SageMaker the script gets them, and the
    arguments the user gave come last, so they win in argparse."""
    at = 2 if script[0] == "-m" else 1
    return [*script[:at], *hyperparameter_args(hyperparameters), *script[at:]]


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
    environment: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The plan's ``launcher`` section. ``environment``: the estimator's own variables, carried into every
    launch as SageMaker set them in the container."""
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
    # what the job's mpirun exported (-x NAME=VALUE in custom_mpi_options: EFA settings) and the estimator's
    # environment reach the ranks under every launcher, not under mpirun alone
    env.update(exported_by_mpi_options(custom))
    env.update(environment or {})
    script_argv = with_hyperparameters([script], hyperparameters)
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
        "hostfile": hostfile_text(hosts, ranks_per_node),
        "env": env,
        "custom_mpi_options": custom,
    }


def exported_by_mpi_options(options: str) -> dict[str, str]:
    """``NAME=VALUE`` pairs that ``-x NAME=VALUE`` in ``custom_mpi_options`` exports (a bare ``-x NAME`` passes
    the launcher's own value, which the ranks inherit anyway)."""
    tokens = shlex.split(options)
    out: dict[str, str] = {}
    for flag, value in zip(tokens, tokens[1:]):
        if flag == "-x" and "=" in value:
            name, _, val = value.partition("=")
            out[name] = val
    return out


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
    framework = framework_params(
        dataparallel=dataparallel,
        custom=custom,
        # SMP v1 only ran under MPI (the SDK refused it otherwise); Hugging Face checks this flag.
        mpi_enabled=True if smp_v1 else bool(mpi.get("enabled", False)),
        ranks_per_node=ranks_per_node,
        instance_type=instance_type,
    )
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
        env[f"SM_HP_{name.upper()}"] = env_value(value)
    return env


def framework_params(
    *, dataparallel: bool, custom: str, mpi_enabled: bool, ranks_per_node: int, instance_type: str | None
) -> dict[str, Any]:
    """The ``sagemaker_*`` keys of ``SM_FRAMEWORK_PARAMS``."""
    framework: dict[str, Any] = {
        "sagemaker_distributed_dataparallel_enabled": dataparallel,
        "sagemaker_mpi_custom_mpi_options": custom,
        "sagemaker_mpi_enabled": mpi_enabled,
        "sagemaker_mpi_num_of_processes_per_host": ranks_per_node,
    }
    if instance_type:
        framework["sagemaker_instance_type"] = instance_type
    return framework


# ---------------------------------------------------------------------------------------------
# one launch on this machine (smp2ds launch)


def local_environment(
    planned: Mapping[str, Any] | None,
    *,
    instance_type: str | None,
    nproc: int,
    nnodes: int,
    node_rank: int,
    gpus: int,
    script: Sequence[str],
    output_dir: str,
    channels: Mapping[str, str],
    addr: str,
    port: int,
    environ: Mapping[str, str],
    cpu_count: int,
) -> dict[str, str]:
    """The variables a SageMaker training container would export for this launch, sorted by name.

    SMP's own variables (``SM_HP_*`` incl. ``SM_HP_MP_PARAMETERS``, ``SM_HPS``,
    ``SM_FRAMEWORK_PARAMS``) come from ``planned``, the plan's launcher env (None without a
    config); what describes *this* machine (hosts, GPUs, folders under the absolute
    ``output_dir``, channels, the script, the rendezvous) is filled in here. ``SM_*`` folders and
    the network interface already set in ``environ`` are kept; ``gpus == 0`` selects DeepSpeed's
    CPU accelerator.
    """
    env: dict[str, str] = {str(k): env_value(v) for k, v in (planned or {}).items()}
    framework = (
        json.loads(env["SM_FRAMEWORK_PARAMS"])
        if "SM_FRAMEWORK_PARAMS" in env
        else framework_params(
            dataparallel=False, custom="", mpi_enabled=True, ranks_per_node=nproc, instance_type=None
        )
    )
    # smdistributed.dataparallel runs as plain torch.distributed data parallelism here: scripts
    # (and Hugging Face's Trainer) must not go looking for the SMDDP library.
    framework["sagemaker_distributed_dataparallel_enabled"] = False
    framework["sagemaker_mpi_num_of_processes_per_host"] = nproc
    framework.setdefault("sagemaker_instance_type", instance_type or "local")
    hosts = hosts_for(nnodes)
    module = script[0] == "-m"
    env.update(
        {
            "SM_FRAMEWORK_PARAMS": env_value(framework),
            "SM_HOSTS": env_value(hosts),
            "SM_CURRENT_HOST": hosts[node_rank],
            "SM_RESOURCE_CONFIG": env_value({"current_host": hosts[node_rank], "hosts": hosts}),
            "SM_NUM_GPUS": str(gpus),
            "SM_NUM_CPUS": str(cpu_count),
            "SM_NETWORK_INTERFACE_NAME": "lo" if nnodes == 1 else environ.get("SM_NETWORK_INTERFACE_NAME", "eth0"),
            "SM_USER_ENTRY_POINT": script[1] if module else script[0],
            "SM_USER_ARGS": env_value(list(script[2:] if module else script[1:])),
            "SM_LOG_LEVEL": "20",
            "SM_MODEL_DIR": environ.get("SM_MODEL_DIR", os.path.join(output_dir, "model")),
            "SM_OUTPUT_DIR": environ.get("SM_OUTPUT_DIR", os.path.join(output_dir, "output")),
            "SM_OUTPUT_DATA_DIR": environ.get("SM_OUTPUT_DATA_DIR", os.path.join(output_dir, "output", "data")),
            "SM_OUTPUT_INTERMEDIATE_DIR": environ.get(
                "SM_OUTPUT_INTERMEDIATE_DIR", os.path.join(output_dir, "output", "intermediate")
            ),
            "SM_CHANNELS": env_value(sorted(channels)),
        }
    )
    env.setdefault("SM_HPS", "{}")
    env.setdefault("SM_CURRENT_INSTANCE_TYPE", framework["sagemaker_instance_type"])
    for name, path in channels.items():
        env[f"SM_CHANNEL_{name.upper()}"] = path
    env.update({"MASTER_ADDR": addr, "MASTER_PORT": str(port)})
    if gpus == 0:
        env["DS_ACCELERATOR"] = "cpu"
    return dict(sorted(env.items()))


def launcher_command(
    launcher: str,
    script: Sequence[str],
    *,
    program: Sequence[str],
    python: str,
    nproc: int,
    nnodes: int,
    node_rank: int,
    addr: str,
    port: int,
    env_names: Sequence[str],
    hostfile: str | None,
) -> list[str]:
    """The command line for ``launcher`` running ``script`` (``[path, args...]`` or ``["-m", mod, args...]``).

    ``program`` starts the launcher (e.g. ``[".../bin/deepspeed"]``); ``python`` is the
    interpreter mpirun starts on every rank; ``env_names`` are the variables mpirun exports.
    """
    module = script[0] == "-m"
    target = list(script[1:] if module else script)
    if not target:
        raise ValueError("`-m` needs a module name after it")
    if launcher == "deepspeed":
        cmd = [*program, "--num_gpus", str(nproc)]
        if nnodes > 1:
            cmd += [
                "--hostfile",
                str(hostfile),
                "--num_nodes",
                str(nnodes),
                "--no_ssh",
                "--node_rank",
                str(node_rank),
                "--master_addr",
                addr,
            ]
        # SMP scripts never parsed --local_rank; DeepSpeed still exports LOCAL_RANK.
        cmd += ["--master_port", str(port), "--no_local_rank"]
        return cmd + (["--module"] if module else []) + target
    if launcher == "torchrun":
        cmd = [
            *program,
            "--nproc-per-node",
            str(nproc),
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--master-addr",
            addr,
            "--master-port",
            str(port),
        ]
        return cmd + (["--module"] if module else []) + target
    if launcher != "mpirun":
        raise ValueError(f"unknown launcher {launcher!r}; expected one of {', '.join(LAUNCHERS)}")
    cmd = [*program, "--allow-run-as-root", "-np", str(nproc), "--oversubscribe", "--bind-to", "none"]
    for name in env_names:
        cmd += ["-x", name]
    return cmd + [python] + (["-m"] if module else []) + target
