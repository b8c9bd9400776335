"""``plan(config, layout) -> Plan``: a validated SMP configuration as DeepSpeed, engine, Megatron
and launcher settings, with the fate of every key the user gave.

Pure: no torch, no deepspeed, no I/O. Each concern lives in its own module (zero, precision,
batch, activation, tensor_parallel, sharded_data, megatron, launcher); this module derives the layout,
assembles the sections (``/engine`` as :class:`~.engine_settings.EngineSettings`, serialised) and
writes the notes. docs/smp-semantics.md lists the SMP semantics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import keymap as km
from .activation import activation_block, engine_activation
from .backend_choice import choose_backend
from .batch import BatchPlan, BatchSettings, plan_batch
from .ds_compat import CLIPPING_DEFAULT_NOTE, check_deepspeed_config
from .engine_settings import DataParallelSettings, EngineSettings, PlacementSettings, ProcessGroupSettings
from .issues import Issue, SMPConfigError
from .launcher import launcher_section
from .megatron import megatron_section
from .normalize import fixups
from .pipeline_schedule import PartitionSettings, PipelineSection, choose_schedule
from .plan_types import Layout, Plan, SMPConfig
from .precision import PrecisionSettings, dtype_of, gradient_clipping, precision_blocks
from .semantics import resolve_v1
from .sharded_data import engine_mics
from .tensor_parallel import engine_tensor_parallel, tensor_parallel_block
from .topology import Topology, tensor_parallel_spread
from .world_layout import ResolvedLayout, check_world, params_pointer, resolve_layout
from .zero import top_level as zero_top_level
from .zero import zero_block, zero_stage

GROUP_LISTING_LIMIT = 64
"""Groups are listed rank by rank up to this world size; larger worlds get counts only."""
STEPS_PER_PRINT = 2**31 - 1
"""SMP printed no DeepSpeed progress lines; a huge interval keeps DeepSpeed quiet too."""
_SCHEDULES = {"interleaved": "1f1b", "simple": "gpipe", "_only_forward": "forward_only"}


def plan(config: SMPConfig, layout: Layout | None = None) -> Plan:
    """Translate ``config`` for ``layout``; raises SMPConfigError when the world is unknown or invalid."""
    resolved = resolve_layout(config, layout)
    issues = list(check_world(config, resolved))
    world = resolved.world_size
    if world is None and not issues:
        issues.append(
            Issue(
                "",
                "the world size (total number of processes) is unknown",
                hint="pass --world-size N (and --gpus-per-node N), or give instance_count with instance_type "
                "or mpi.processes_per_host",
            )
        )
    if issues or world is None:
        raise SMPConfigError(issues)
    params = effective_params(config, world)
    topo = _topology(config, params, world)
    remarks: list[str] = []
    rpn, nodes = _nodes(resolved, remarks)
    spread = tensor_parallel_spread(topo, rpn)
    if spread:
        remarks.append(spread)
    overridden = _world_override(config, resolved)
    if overridden:
        remarks.append(overridden)
    batch = plan_batch(
        per_rank_batch=resolved.batch_size,
        microbatches=params["microbatches"],
        tp=topo.tp,
        rdp=topo.rdp,
        shard_size=params["sharded_data_parallel_degree"],
        prescaled_batch=bool(params["prescaled_batch"]),
    )
    pipeline = _engine_pipeline(params, remarks)
    deepspeed = _deepspeed(params, batch)
    engine = _engine(config, params, topo, batch, pipeline, rpn, resolved, remarks)
    megatron, mremarks = megatron_section(
        pp=topo.pp,
        tp=topo.tp,
        rdp=topo.rdp,
        letters=topo.order,
        dtype=dtype_of(params),
        fp16=deepspeed["fp16"],
        clipping=deepspeed["gradient_clipping"],
        zero_stage=deepspeed["zero_optimization"]["stage"],
        shard_size=params["sharded_data_parallel_degree"],
        batch=batch,
        offload_activations=bool(params["offload_activations"]),
        schedule=pipeline.schedule,
    )
    launcher = launcher_section(
        given=config.given,
        smp_version=config.smp_version,
        strategy=config.strategy,
        world_size=topo.world_size,
        ranks_per_node=rpn,
        nodes=nodes,
        pp=topo.pp,
        port=params.get("ddp_port"),
        mpi=config.mpi,
        instance_type=config.instance_type,
        hyperparameters=config.hyperparameters,
        environment=config.environment,
    )
    remarks += _remarks(config, params, topo, batch, resolved)
    remarks += mremarks
    problems = check_deepspeed_config(deepspeed)
    if problems:  # a bug in the translator, never the user's input
        raise RuntimeError(
            "smp2ds emitted a DeepSpeed config it knows is invalid: " + "; ".join(map(str, problems))
        )
    return Plan(
        topology=_topology_section(params, topo, rpn, nodes, resolved),
        deepspeed=deepspeed,
        engine=engine.to_dict(),
        megatron=megatron,
        launcher=launcher,
        notes=km.key_notes(config, params),
        remarks=tuple(remarks),
    )


def effective_params(config: SMPConfig, world_size: int) -> dict[str, Any]:
    """Canonical v1 parameters that describe the run, whatever the input dialect.

    SMP v1: the resolved parameters. ``smdistributed.dataparallel``: defaults with data
    parallelism on. SMP v2: tensor_parallel_degree as given and ``hybrid_shard_degree`` as the
    shard size (0 = all data-parallel ranks of one tensor-parallel slice, 1 = none).
    """
    params = resolve_v1({})
    params.update(config.params)
    if config.strategy == "dataparallel":
        params.update(resolve_v1({"ddp": True}))
    elif config.smp_version == 2:
        v2 = config.v2
        tp = int(v2.get("tensor_parallel_degree", 1) or 1)
        shard = int(v2.get("hybrid_shard_degree", 0) or 0)
        params.update(
            tensor_parallel_degree=tp,
            sharded_data_parallel_degree=(world_size // tp) if shard == 0 else shard,
            ddp=True,
        )
        if v2.get("activation_loading_horizon") is not None:
            params["activation_loading_horizon"] = v2["activation_loading_horizon"]
    return params


def _topology(config: SMPConfig, params: Mapping[str, Any], world: int) -> Topology:
    pp, tp, shard = (
        params["pipeline_parallel_degree"],
        params["tensor_parallel_degree"],
        params["sharded_data_parallel_degree"],
    )
    issues: list[Issue] = []
    try:
        topo = Topology.for_world(world, pp, tp, params["placement_strategy"])
    except ValueError as err:
        raise SMPConfigError([Issue(params_pointer(config, "pipeline_parallel_degree"), str(err))]) from None
    sdp_key = "hybrid_shard_degree" if config.smp_version == 2 else "sharded_data_parallel_degree"
    # Shard groups lie inside the reduced-data-parallel group (rdp = dp without tensor parallelism).
    if shard > 1 and topo.rdp % shard:
        what = "data-parallel degree" if tp == 1 else "reduced data-parallel degree world / (pp x tp) ="
        issues.append(
            Issue(
                params_pointer(config, sdp_key),
                f"shard size {shard} does not divide the {what} {topo.rdp}",
                given=shard,
                allowed=", ".join(str(d) for d in range(1, topo.rdp + 1) if topo.rdp % d == 0),
            )
        )
    if shard > 1 and pp > 1:
        issues.append(
            Issue(
                params_pointer(config, sdp_key),
                f"sharded data parallelism (ZeRO-3) cannot run with pipeline_parallel_degree({pp}) > 1: "
                f"DeepSpeed's "
                "pipeline engine accepts ZeRO stages 0 and 1 only",
                given=shard,
                hint="use pipeline_parallel_degree 1, or shard_optimizer_state (ZeRO-1) with the pipeline",
            )
        )
    if issues:
        raise SMPConfigError(issues)
    return topo


def _nodes(resolved: ResolvedLayout, remarks: list[str]) -> tuple[int, int]:
    world = resolved.world_size or 1
    if resolved.ranks_per_node is None:
        remarks.append(
            f"ranks per node unknown: the launcher and node-locality decisions assume one node of {world}"
        )
        return world, 1
    return resolved.ranks_per_node, resolved.nodes or max(1, world // resolved.ranks_per_node)


def _deepspeed(params: Mapping[str, Any], batch: BatchPlan) -> dict[str, Any]:
    ds: dict[str, Any] = dict(batch.deepspeed_keys())
    ds["steps_per_print"] = STEPS_PER_PRINT
    ds["gradient_clipping"] = gradient_clipping(params)
    ds["zero_optimization"] = zero_block(params)
    ds.update(zero_top_level(params))
    ds.update(precision_blocks(params))
    ds["activation_checkpointing"] = activation_block(params)
    if params["pipeline_parallel_degree"] > 1:
        # The only keys DeepSpeed's PipelineEngine reads; stages/partition come from PipelineModule.
        # Partitioning activations over the model (tensor-parallel) axis between stages assumes the
        # group holds identical activations; with SMP's prescaled_batch false each rank's are its own.
        split = params.get("tensor_parallel_degree", 1) == 1
        ds["pipeline"] = {
            "activation_checkpoint_interval": 0,
            "pipe_partitioned": split,
            "grad_partitioned": split,
            "use_reentrant": True,
        }
    tp_block = tensor_parallel_block(params)
    if tp_block:
        ds["tensor_parallel"] = tp_block
    return ds


def _engine_pipeline(params: Mapping[str, Any], remarks: list[str]) -> PipelineSection:
    pp, m = params["pipeline_parallel_degree"], params["microbatches"]
    active = params.get("active_microbatches") or max(1, min(pp + 2, m))
    schedule = _SCHEDULES.get(params["pipeline"], "1f1b")
    if pp > 1 and schedule == "gpipe" and active != m:
        # SMP's loader does the same: the simple schedule needs every micro-batch in flight.
        remarks.append(
            f"pipeline 'simple' with active_microbatches({active}) != microbatches({m}): SMP forces "
            "'interleaved' (1F1B), so does the plan"
        )
        schedule = "1f1b"
    choice = choose_schedule(params["pipeline"], m, active, pp)
    if schedule != "forward_only":
        schedule = choice.kind  # one decision: what the engine runs is what the plan says
    return PipelineSection(
        enabled=pp > 1,
        stages=pp,
        schedule=schedule,
        schedule_choice=choice,
        microbatches=m,
        active_microbatches=active,
        partition=PartitionSettings(
            auto=bool(params["auto_partition"]),
            memory_weight=params["memory_weight"],
            default_partition=params["default_partition"],
        ),
    )


def _engine(
    config: SMPConfig,
    params: Mapping[str, Any],
    topo: Topology,
    batch: BatchPlan,
    pipeline: PipelineSection,
    rpn: int,
    resolved: ResolvedLayout,
    remarks: list[str],
) -> EngineSettings:
    seed = config.v2.get("random_seed") if config.smp_version == 2 else None
    mics = engine_mics(params, topo, rpn, list_groups=topo.world_size <= GROUP_LISTING_LIMIT, remarks=remarks)
    tensor_parallel = engine_tensor_parallel(params, seed)
    backend = choose_backend(pipeline=pipeline.enabled, tensor_parallel=tensor_parallel.enabled,
                             mics=mics.enabled)
    return EngineSettings(
        backend=backend,
        smp_version=config.smp_version,
        strategy=config.strategy,
        microbatches=params["microbatches"],
        placement=PlacementSettings(strategy=params["placement_strategy"], order=topo.order),
        process_group=ProcessGroupSettings(backend=params["ddp_dist_backend"], port=params.get("ddp_port")),
        # Replicas are data-parallel whatever SMP flag asked for them (ddp, or horovod on TF).
        data_parallel=DataParallelSettings(
            enabled=bool(params["ddp"]) or topo.rdp > 1, rdp_degree=topo.rdp, dp_degree=topo.dp,
            ddp_api=bool(params["ddp"]),
        ),
        batch=BatchSettings.of(batch, prescaled_batch=bool(params["prescaled_batch"]), source=resolved.batch_source),
        zero_stage=zero_stage(params),
        mics=mics,
        pipeline=pipeline,
        tensor_parallel=tensor_parallel,
        precision=PrecisionSettings(dtype=dtype_of(params)),
        activation_checkpointing=engine_activation(params),
        delayed_parameter_initialization=bool(params["delayed_parameter_initialization"]),
    )


def _topology_section(
    params: Mapping[str, Any], topo: Topology, rpn: int, nodes: int, resolved: ResolvedLayout
) -> dict[str, Any]:
    shard = params["sharded_data_parallel_degree"]
    out: dict[str, Any] = {
        "world_size": topo.world_size,
        "world_source": resolved.world_source,
        "pipeline_parallel_degree": topo.pp,
        "tensor_parallel_degree": topo.tp,
        "rdp_degree": topo.rdp,
        "dp_degree": topo.dp,
        "mp_degree": topo.mp,
        "sharded_data_parallel_degree": shard,
        "replicas": topo.rdp // shard,
        "placement_strategy": params["placement_strategy"],
        "placement": topo.order,
        "ranks_per_node": rpn,
        "nodes": nodes,
    }
    if topo.world_size <= GROUP_LISTING_LIMIT:
        out["groups"] = {kind: topo.groups(kind) for kind in ("pp", "tp", "rdp", "dp", "mp")}
        if shard > 1:
            out["shard_groups"] = topo.shard_groups(shard)
            out["replica_groups"] = topo.replica_groups(shard)
    else:
        out["groups"] = None
    return out


def _world_override(config: SMPConfig, resolved: ResolvedLayout) -> str | None:
    """A warning when an explicit world size replaces what the estimator's instances give."""
    count, per_node = config.instance_count, resolved.ranks_per_node
    if resolved.world_source != "layout" or not count or not per_node:
        return None
    estimator_world = count * per_node
    if resolved.world_size == estimator_world or resolved.nodes == count:
        return None
    return (f"warning: the world size {resolved.world_size} given replaces the estimator's instance_count({count}) "
            f"x {per_node} processes = {estimator_world}; the plan is for {resolved.world_size} ranks")


def _remarks(
    config: SMPConfig, params: Mapping[str, Any], topo: Topology, batch: BatchPlan, resolved: ResolvedLayout
) -> list[str]:
    out: list[str] = list(fixups(config)) if config.smp_version == 1 else []
    if config.strategy == "dataparallel":
        out.append(
            f"smdistributed.dataparallel: plain data parallelism over {topo.world_size} ranks (DeepSpeed, "
            "ZeRO stage 0); SMDDP's collectives are replaced by NCCL (GPU) or gloo (CPU)"
        )
    if config.smp_version == 2:
        out.append(
            "SMP v2 input: the plan maps its layout; torch.sagemaker scripts (tsm.init / tsm.transform) are "
            "not run unchanged by the engine, which implements the SMP v1 API"
        )
    if batch.per_rank_batch is None:
        out.append(
            "train_batch_size and train_micro_batch_size_per_gpu are missing because the per-rank batch size "
            "is unknown (pass --batch-size, or a per_device_train_batch_size / train_batch_size "
            "hyperparameter); the engine fills them at run time from the batch smp.step receives"
        )
    else:
        out.append(
            f"per-rank batch {batch.per_rank_batch} (from {resolved.batch_source}) split into "
            f"{batch.microbatches} micro-batches of {batch.micro_batch}; DeepSpeed checks "
            f"train_batch_size against its data-parallel size {batch.deepspeed_data_parallel_size}; "
            f"samples per optimizer step across the job: {batch.global_batch_size}"
        )
        if batch.tp_input_gather:
            out.append(
                f"prescaled_batch is false: the engine gathers the {topo.tp} tensor-parallel ranks' batches, "
                f"so DeepSpeed's micro-batch is {topo.tp} x {batch.micro_batch}"
            )
    if params["sharded_data_parallel_degree"] > 1:
        out.append(
            "with sharded data parallelism DeepSpeed sees the shard group as its data-parallel group, so its "
            "train_batch_size counts one shard group; the engine all-reduces gradients across replicas"
        )
    out.append(CLIPPING_DEFAULT_NOTE)
    if dtype_of(params) == "fp16":
        out.append(
            "fp16 loss scaling: the plan shows SMP's dynamic-scaler defaults (2**32, window 1000, hysteresis "
            "1); smp.DistributedOptimizer's arguments replace them at run time (its own default is a static "
            "scale of 1.0)"
        )
    if topo.pp > 1:
        out.append(
            "DeepSpeed's pipeline engine needs the model as a layer list: the engine builds it for "
            "nn.Sequential, GPT-2, BERT and LLaMA; ZeRO-2/3 cannot be combined with the pipeline"
        )
    if config.strategy == "modelparallel" and topo.world_size > 1:
        out.append("launcher env: SM_CURRENT_HOST is the first host here; each host sets its own")
    return out
