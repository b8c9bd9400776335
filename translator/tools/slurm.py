"""``smp2ds convert --to slurm``: an estimator's job as an sbatch script.

The allocation has the plan's nodes with one task each (``--ntasks-per-node=1``), each node whole
(``--exclusive``, and ``srun --cpus-per-task`` the node's CPUs: under cgroup binding one task would otherwise get one
core for all its ranks and their data loaders) and, unless ``--cpu``, the node's ranks in GPUs
(``--gpus-per-node``). The script changes to the estimator's ``source_dir`` (relative to the submit directory)
before ``srun``, as SageMaker ran the entry point from it, and leaves out AWS's EFA variables unless ``--efa``
keeps them. The script exports the SageMaker environment exactly as
``convert --to torchrun`` does (``cluster_job``), takes the master's address from the allocation
(``scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1``) and runs ``srun``, one task per node, each
starting ``torchrun`` with a c10d rendezvous on that host: torchrun numbers the nodes itself, so no node rank
is passed. Names a shell cannot export (a hyperparameter ``checkpoint-dir`` gives ``SM_HP_CHECKPOINT-DIR``)
reach the ranks through ``env`` on the srun command line.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from smp2ds.translator.launcher import shell_name
from smp2ds.translator.tools.cluster_job import free_of

RDZV_PORT = 29400
"""torchrun's own default port for a c10d rendezvous endpoint; ``$RDZV_PORT`` overrides it at submission."""
NODE_HOST = 'export SM_CURRENT_HOST="algo-$((SLURM_NODEID + 1))"; exec "$@"'
"""Run by ``sh -c`` on each node: SageMaker's name of this node (``algo-1`` on the master), then the command."""


def check_sbatch_options(options: Sequence[str]) -> list[str]:
    """``--sbatch`` values: each one sbatch option (``--partition=gpu``); anything else is a `ValueError`."""
    out = []
    for option in options:
        text = option.strip()
        if not text.startswith("-") or "\n" in text:
            raise ValueError(f"--sbatch expects one sbatch option such as --sbatch=--partition=gpu, got {option!r}")
        out.append(text)
    return out


def job_name(source: str) -> str:
    """A Slurm job name from the input file's name (``gpt2_30b.json`` -> ``smp2ds-gpt2_30b``)."""
    stem = re.sub(r"\.[^./]*$", "", source.rsplit("/", 1)[-1]) if source not in ("-", "<stdin>") else "job"
    return "smp2ds-" + (re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-") or "job")


def srun_command(job: Mapping[str, Any]) -> list[str]:
    """The argv of the srun line; ``$MASTER_ADDR``, ``$RDZV_PORT`` and ``$SLURM_JOB_ID`` stay for the shell."""
    nodes, nproc = int(job["nodes"]), int(job["nproc_per_node"])
    cmd = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", CPUS_PER_TASK,
           "--kill-on-bad-exit=1"]
    if nodes > 1:
        cmd += ["sh", "-c", NODE_HOST, "smp2ds-node"]
    # after the shell: sh (dash) drops names it cannot hold from the environment of what it execs
    passed = [f"{name}={value}" for name, value in job["env"].items() if not shell_name(name)]
    if passed:
        cmd += ["env", *passed]
    cmd += ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "$MASTER_ADDR:$RDZV_PORT", "--rdzv-id", "$SLURM_JOB_ID"]
    return cmd + list(job["script"])


CPUS_PER_TASK = "--cpus-per-task=$SLURM_CPUS_ON_NODE"
"""The one task of a node takes every CPU the (exclusive) allocation has there."""
_SHELL_WORDS = {"$MASTER_ADDR:$RDZV_PORT": '"$MASTER_ADDR:$RDZV_PORT"', "$SLURM_JOB_ID": '"$SLURM_JOB_ID"',
                CPUS_PER_TASK: '--cpus-per-task="$SLURM_CPUS_ON_NODE"'}


def sbatch_directives(job: Mapping[str, Any], name: str, gpus: bool, extra: Sequence[str]) -> list[str]:
    """The ``#SBATCH`` options: name, nodes, one task per node, GPUs per node (unless ``gpus`` is false), extra."""
    out = [f"--job-name={name}", f"--nodes={job['nodes']}", "--ntasks-per-node=1", "--exclusive"]
    if gpus:
        out.append(f"--gpus-per-node={job['nproc_per_node']}")
    return out + list(extra)


def render_sbatch(job: Mapping[str, Any], *, name: str, gpus: bool = True, extra: Sequence[str] = (),
                  instance: str | None = None) -> str:
    """The job as an sbatch script (see the module docstring)."""
    nodes, nproc = int(job["nodes"]), int(job["nproc_per_node"])
    port = free_of(RDZV_PORT, job.get("ddp_port"))
    lines = ["#!/bin/bash"]
    lines += [f"#SBATCH {option}" for option in sbatch_directives(job, name, gpus, extra)]
    lines += [
        f"# smp2ds convert --to slurm: {nodes} node(s) x {nproc} process(es) per node = {job['world_size']} ranks"
        + (f" ({instance})" if instance else ""),
        "# submit: sbatch THIS_FILE (from the folder the "
        + ("source_dir" if job.get("source_dir") else "script path below") + " is relative to)",
        f"# srun starts one task per node: torchrun, which starts the node's {nproc} process(es); the nodes meet in",
        f"# torchrun's c10d rendezvous on the allocation's first host, port $RDZV_PORT (default {port})",
        "set -e",
    ]
    if job.get("left_out"):
        lines.append(f"# left out: {', '.join(job['left_out'])} (AWS's EFA settings from the estimator; off AWS they "
                     "stop NCCL finding its network): convert with --efa to keep them")
    if not gpus:
        lines.append("export DS_ACCELERATOR=cpu  # --cpu: the ranks run on the CPU (gloo)")
    for env_name, value in job["env"].items():
        if shell_name(env_name):
            lines.append(f"export {env_name}={shlex.quote(str(value))}")
    if job.get("mapped_dirs"):
        lines.append("mkdir -p " + " ".join(shlex.quote(str(d)) for d in job["mapped_dirs"]))
    lines += _source_dir_lines(job.get("source_dir"))
    lines += [
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        "export MASTER_ADDR",
        f'RDZV_PORT="${{RDZV_PORT:-{port}}}"',
        " ".join(_SHELL_WORDS.get(word) or shlex.quote(word) for word in srun_command(job)),
    ]
    return "\n".join(lines) + "\n"


def _source_dir_lines(source_dir: str | None) -> list[str]:
    """``cd`` into the estimator's ``source_dir`` (relative: to the submit directory), as SageMaker ran the entry point
    from it; a remote one (``s3://``) cannot be entered and is named for the user to unpack."""
    if not source_dir:
        return []
    if "://" in source_dir:
        return [f"# source_dir {source_dir} is remote: unpack it here and cd into it; SageMaker ran the entry "
                "point from it"]
    target = shlex.quote(source_dir)
    where = target if source_dir.startswith("/") else f'"${{SLURM_SUBMIT_DIR:-.}}"/{target}'
    return [f"cd {where}  # the estimator's source_dir: SageMaker ran the entry point from it"]


def slurm_spec(job: Mapping[str, Any], *, name: str, gpus: bool = True, extra: Sequence[str] = (),
               instance: str | None = None) -> dict[str, Any]:
    """What ``--to slurm --format json`` prints: the directives, the environment, the srun argv and the script."""
    return {
        "launcher": "slurm",
        "nodes": int(job["nodes"]),
        "nproc_per_node": int(job["nproc_per_node"]),
        "world_size": int(job["world_size"]),
        "sbatch": sbatch_directives(job, name, gpus, extra),
        "env": dict(job["env"]),
        "command": srun_command(job),
        "script": render_sbatch(job, name=name, gpus=gpus, extra=extra, instance=instance),
    }
