"""The world an SMP configuration runs on: world size, ranks per node, batch, and SMP's checks on it.

Where each number comes from, first match wins:
  * world_size: ``Layout.world_size``; else ``instance_count`` x ranks per node.
  * ranks per node: ``Layout.gpus_per_node``; else ``mpi.processes_per_host``; else the GPUs of
    ``instance_type`` (1 on CPU instances), as SageMaker's MPI runner does.
  * batch size (the per-rank batch an ``@smp.step`` function receives): ``Layout.batch_size``;
    else the first of these hyperparameters holding a positive integer:
      - ``per_device_train_batch_size``: HF Trainer's per-process batch (HF passes it to smp.step);
      - ``train_batch_size``: what the SMP example scripts (BERT, GPT-2, GPT-J, GPT-NeoX) call the
        per-rank batch they hand to smp.step;
      - ``batch_size`` / ``batch-size``: the per-rank batch of the SMP MNIST-style examples.
    SageMaker passes hyperparameters as strings, so digit strings count too. Anything else
    (e.g. HF's ``total_train_batch_size``, a global figure) is not guessed at: the batch stays None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .document import PARAMS_PATH_IN_DISTRIBUTION, pointer_of
from .instances import gpus_for, processes_for
from .issues import Issue
from .plan_types import Layout, SMPConfig

BATCH_HYPERPARAMETERS: tuple[str, ...] = (
    "per_device_train_batch_size",
    "train_batch_size",
    "batch_size",
    "batch-size",
)


@dataclass(frozen=True, kw_only=True)
class ResolvedLayout:
    """The machine layout with every derivable number filled in; None where unknown."""

    world_size: int | None = None
    ranks_per_node: int | None = None
    nodes: int | None = None
    """world_size / ranks_per_node when that divides; None otherwise (check_world reports it)."""
    batch_size: int | None = None
    """Per-rank batch handed to ``@smp.step``."""
    batch_source: str | None = None
    """Where batch_size came from: ``layout`` or ``hyperparameters.<name>``."""
    gpus_per_instance: int | None = None
    """GPUs of the instance type (0 for CPU types), None when the type is unknown or absent."""
    world_source: str | None = None
    """How world_size was obtained, printed in messages (``layout``, ``instance_count(2) x ...``)."""


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, str) and value.strip().isdigit() and int(value) >= 1:
        return int(value)
    return None


def _batch(config: SMPConfig, layout: Layout) -> tuple[int | None, str | None]:
    if layout.batch_size is not None:
        return layout.batch_size, "layout"
    for name in BATCH_HYPERPARAMETERS:
        value = _positive_int(config.hyperparameters.get(name))
        if value is not None:
            return value, f"hyperparameters.{name}"
    return None, None


def resolve_layout(config: SMPConfig, layout: Layout | None = None) -> ResolvedLayout:
    """Combine an explicit Layout with what the estimator spec says (explicit values win)."""
    layout = layout or Layout()
    gpus = gpus_for(config.instance_type)
    ppn = _positive_int(config.mpi.get("processes_per_host"))
    per_node: int | None
    per_node_src: str | None
    if layout.gpus_per_node:
        per_node, per_node_src = layout.gpus_per_node, f"gpus_per_node({layout.gpus_per_node})"
    elif ppn:
        per_node, per_node_src = ppn, f"processes_per_host({ppn})"
    else:
        per_node = processes_for(config.instance_type)
        per_node_src = f"GPUs of {config.instance_type}({per_node})" if per_node else None
    world, source = None, None
    if layout.world_size:
        world, source = layout.world_size, "layout"
    elif isinstance(config.instance_count, int) and config.instance_count >= 1 and per_node:
        world = config.instance_count * per_node
        source = f"instance_count({config.instance_count}) x {per_node_src}"
    nodes = None
    if world and per_node:
        if world <= per_node:
            per_node, nodes = world, 1  # a world smaller than one node runs on one node
        elif world % per_node == 0:
            nodes = world // per_node
    batch, batch_source = _batch(config, layout)
    return ResolvedLayout(
        world_size=world,
        ranks_per_node=per_node,
        nodes=nodes,
        batch_size=batch,
        batch_source=batch_source,
        gpus_per_instance=gpus,
        world_source=source,
    )


def smallest_world(config: SMPConfig) -> int:
    """The fewest processes the configuration's degrees fit (one model replica): pipeline x tensor x
    sharded-data-parallel degree."""
    params = config.params
    world = 1
    for key in ("pipeline_parallel_degree", "tensor_parallel_degree", "sharded_data_parallel_degree"):
        world *= max(1, int(params.get(key) or 1))
    return world


def params_pointer(config: SMPConfig, key: str) -> str:
    """Pointer of an SMP key in the user's document: where it is, or where it would go."""
    if key in config.pointers:
        return config.pointers[key]
    if key == "pipeline_parallel_degree" and "partitions" in config.pointers:
        return config.pointers["partitions"]
    prefix: tuple[str, ...] = ()
    if config.kind == "distribution":
        prefix = PARAMS_PATH_IN_DISTRIBUTION
    elif config.kind == "estimator":
        prefix = ("distribution",) + PARAMS_PATH_IN_DISTRIBUTION
    return pointer_of(prefix + (key,))


def _mpi_pointer(config: SMPConfig, key: str) -> str:
    prefix = ("distribution",) if config.kind == "estimator" else ()
    return pointer_of(prefix + ("mpi", key))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _node_issues(config: SMPConfig, world: ResolvedLayout) -> list[Issue]:
    issues = []
    ppn = _positive_int(config.mpi.get("processes_per_host"))
    gpus = world.gpus_per_instance
    # On CPU instances (0 GPUs) there is nothing to oversubscribe; smp2ds runs CPU ranks anyway.
    if ppn and gpus and ppn > gpus:
        issues.append(
            Issue(
                _mpi_pointer(config, "processes_per_host"),
                f"processes_per_host({ppn}) exceeds the {gpus} GPUs of {config.instance_type}",
                given=ppn,
                allowed=f"1..{gpus}",
                hint=f"set `processes_per_host: {gpus}`",
            )
        )
    if world.world_size and world.ranks_per_node and world.nodes is None:
        issues.append(
            Issue(
                "",
                f"world_size({world.world_size}) is not a multiple of the ranks per node "
                f"({world.ranks_per_node})",
                given=world.world_size,
                hint="use whole nodes: world_size = nodes x ranks per node",
            )
        )
    return issues


def _v1_world_issues(config: SMPConfig, world: int, source: str) -> list[Issue]:
    pp, tp = config.pipeline_parallel_degree, config.tensor_parallel_degree
    mp = pp * tp
    at_mp = params_pointer(
        config, "pipeline_parallel_degree" if pp > 1 or tp == 1 else "tensor_parallel_degree"
    )
    formula = f"pipeline_parallel_degree({pp}) * tensor_parallel_degree({tp}) = {mp}"
    where = f"world_size comes from {source}"
    # The mistake is usually the process count, so the hint says how to change it, then where it came from.
    fix = (
        f"start a multiple of {mp} processes (torchrun --nproc-per-node, deepspeed --num_gpus, mpirun -np) "
        f"or lower the degrees; {where}"
    )
    if mp > world:
        return [
            Issue(
                at_mp,
                f"{formula} exceeds world_size({world})",
                given=mp,
                allowed=f"a product that divides {world}: {_divisors(world)}",
                hint=fix,
            )
        ]
    if world % mp:
        return [
            Issue(
                at_mp,
                f"world_size({world}) is not divisible by {formula}",
                given=mp,
                allowed=f"a product that divides {world}: {_divisors(world)}",
                hint=fix,
            )
        ]
    issues = []
    replicas = world // mp
    if replicas > 1 and not (config.ddp or config.horovod):
        issues.append(
            Issue(
                params_pointer(config, "ddp"),
                f"world_size({world}) > {formula}: the {replicas} model replicas need ddp: true",
                given=config.ddp,
                hint=f"set `ddp: true` ({where})",
            )
        )
    sdp = config.sharded_data_parallel_degree
    dp = world // pp
    if sdp > 1 and (sdp > dp or dp % sdp):
        verb = "exceeds" if sdp > dp else "does not divide"
        issues.append(
            Issue(
                params_pointer(config, "sharded_data_parallel_degree"),
                f"sharded_data_parallel_degree({sdp}) {verb} the data-parallel degree "
                f"world_size({world}) / pipeline_parallel_degree({pp}) = {dp}",
                given=sdp,
                allowed=_divisors(dp),
                hint=where,
            )
        )
    return issues


def _v2_world_issues(config: SMPConfig, world: int, source: str) -> list[Issue]:
    issues = []
    for key in (
        "hybrid_shard_degree",
        "tensor_parallel_degree",
        "context_parallel_degree",
        "expert_parallel_degree",
    ):
        value = config.v2.get(key)
        if isinstance(value, int) and value > world:
            issues.append(
                Issue(
                    params_pointer(config, key),
                    f"{key}({value}) exceeds world_size({world})",
                    given=value,
                    allowed=f"0..{world}" if key == "hybrid_shard_degree" else f"1..{world}",
                    hint=f"world_size comes from {source}",
                )
            )
    tp = config.v2.get("tensor_parallel_degree", 1)
    if isinstance(tp, int) and tp <= world and world % tp:
        issues.append(
            Issue(
                params_pointer(config, "tensor_parallel_degree"),
                f"world_size({world}) is not divisible by tensor_parallel_degree({tp})",
                given=tp,
                allowed=_divisors(world),
            )
        )
    return issues


def check_world(config: SMPConfig, resolved: ResolvedLayout) -> list[Issue]:
    """SMP's world-size checks (library init) and the per-node and batch arithmetic."""
    issues = _node_issues(config, resolved)
    world, source = resolved.world_size, resolved.world_source or "layout"
    if world and config.strategy == "modelparallel":
        if config.smp_version == 2:
            issues.extend(_v2_world_issues(config, world, source))
        else:
            issues.extend(_v1_world_issues(config, world, source))
    if resolved.batch_size and config.strategy == "modelparallel" and config.smp_version == 1:
        m = config.microbatches
        if resolved.batch_size % m:
            issues.append(
                Issue(
                    params_pointer(config, "microbatches"),
                    f"batch size({resolved.batch_size}) from {resolved.batch_source} is not divisible "
                    f"by microbatches({m})",
                    given=m,
                    allowed=_divisors(resolved.batch_size),
                    hint="smp.step splits every batch into `microbatches` equal pieces",
                )
            )
    return issues
