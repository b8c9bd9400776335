"""What a Slurm allocation says about this launch: nodes, this node's rank, the master's address, processes per node.

``smp2ds launch`` run inside an allocation takes its defaults from Slurm's ``SLURM_*`` variables, as accelerate and
PyTorch Lightning do: ``--nnodes`` from ``SLURM_STEP_NUM_NODES`` / ``SLURM_NNODES``, ``--node-rank`` from
``SLURM_NODEID``, ``--master-addr`` from the first host of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` (what
``scontrol show hostnames`` prints first) and ``--nproc-per-node`` from ``SLURM_GPUS_ON_NODE``, else
``SLURM_NTASKS_PER_NODE`` when above 1 (the batch script of ``sbatch --ntasks-per-node=8``). smp2ds starts the
node's processes itself (one launcher per node), so:

* inside ``srun`` (a job step: ``SLURM_STEP_ID`` is set) each node must run one task
  (``srun --ntasks-per-node=1``); several would each start the node's processes;
* in the batch script itself (no step) only the first node runs: an allocation of several nodes then needs
  ``srun`` to start smp2ds on each of them.

Pure: the environment is passed in; nothing runs ``scontrol``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class SlurmEnvError(ValueError):
    """The ``SLURM_*`` variables describe a launch smp2ds cannot take defaults from (the message says why)."""


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``node[01-03,7],gpu-a1``) as host names, in order.

    Brackets may appear more than once in a name (``rack[1-2]-n[1-2]``: the product, in Slurm's order).
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        if item:
            hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SlurmEnvError(f"unbalanced ']' in Slurm host list {text!r}")
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise SlurmEnvError(f"unbalanced '[' in Slurm host list {text!r}")
    items.append(text[start:])
    return items


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    prefix, suffix = item[: match.start()], item[match.end():]
    out: list[str] = []
    for part in match.group(1).split(","):
        bounds = _RANGE.match(part.strip())
        if bounds is None:
            raise SlurmEnvError(f"cannot read range {part!r} in Slurm host list {item!r}")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        width = len(low)  # node[01-10]: zero-padded to the width of the lower bound
        for number in range(int(low), int(high) + 1):
            out.extend(_expand_one(f"{prefix}{number:0{width}d}{suffix}"))
    return out


def _count(env: Mapping[str, str], name: str) -> int | None:
    """A count variable; Slurm writes repeated counts as ``8(x2),4`` (the first node's value is used)."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    match = re.match(r"^(\d+)", raw)
    if match is None:
        raise SlurmEnvError(f"environment variable {name}={raw!r} is not a count")
    return int(match.group(1))


def in_allocation(env: Mapping[str, str]) -> bool:
    """Whether this process runs inside a Slurm job (batch script, ``salloc`` shell or ``srun`` step)."""
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def launch_defaults(env: Mapping[str, str], nnodes: int | None = None) -> dict[str, Any] | None:
    """Defaults for ``smp2ds launch`` from the allocation: ``nnodes``, ``node_rank``, ``master_addr`` (None for one
    node), ``nproc`` (None when Slurm does not say) and ``source`` (a one-line description); None outside Slurm.

    ``nnodes``: the node count given on the command line, if any (it wins over Slurm's). Raises `SlurmEnvError`
    when smp2ds would start the node's processes more than once, or on one node of several.
    """
    if not in_allocation(env):
        return None
    step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
    nodelist = (env.get("SLURM_STEP_NODELIST") if step else None) or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST") or ""
    hosts = expand_hostlist(nodelist) if nodelist else []
    allocated = (_count(env, "SLURM_STEP_NUM_NODES") if step else None) or _count(env, "SLURM_NNODES") \
        or _count(env, "SLURM_JOB_NUM_NODES") or len(hosts) or 1
    tasks_here = _count(env, "SLURM_STEP_TASKS_PER_NODE") if step else None
    if tasks_here is not None and tasks_here > 1:
        raise SlurmEnvError(
            f"srun started {tasks_here} tasks on this node (SLURM_STEP_TASKS_PER_NODE="
            f"{env.get('SLURM_STEP_TASKS_PER_NODE')}); smp2ds launch starts the node's processes itself, so run one "
            "task per node: srun --ntasks-per-node=1 --ntasks=$SLURM_JOB_NUM_NODES smp2ds launch ...")
    if nnodes is None and not step and allocated > 1:
        raise SlurmEnvError(
            f"this Slurm job has {allocated} nodes but smp2ds launch runs outside srun, on the first node only; "
            "start it on every node with srun --ntasks-per-node=1 --ntasks=$SLURM_JOB_NUM_NODES smp2ds launch ..., "
            "or pass --nnodes 1 to run on this node alone")
    count = allocated if nnodes is None else nnodes
    node_rank = (_count(env, "SLURM_NODEID") or 0) if step else 0
    if not 0 <= node_rank < count:
        raise SlurmEnvError(f"SLURM_NODEID={node_rank} is outside the launch's {count} node(s) (--nnodes)")
    # one task per node says nothing about the processes (srun --ntasks-per-node=1 sets it so inside the step)
    tasks = _count(env, "SLURM_NTASKS_PER_NODE")
    nproc = _count(env, "SLURM_GPUS_ON_NODE") or (tasks if tasks and tasks > 1 else None)
    master = hosts[0] if count > 1 and hosts else None
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    source = f"Slurm job {job}: {count} node(s), this is node {node_rank}" + (f", master {master}" if master else "")
    return {"nnodes": count, "node_rank": node_rank, "master_addr": master, "nproc": nproc, "source": source}
