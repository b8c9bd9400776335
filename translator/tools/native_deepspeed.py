"""``smp2ds convert FILE --to deepspeed --native``: a DeepSpeed config for a plain ``deepspeed.initialize`` script.

``convert --to deepspeed`` writes the config smp2ds's engine runs, whose batch sizes count what the engine hands
DeepSpeed (one shard group under sharded data parallelism, the micro-batches SMP splits a batch into). A team leaving
SMP needs the config its own DeepSpeed script uses at the job's layout; this module writes it and lists every place
where native DeepSpeed's semantics differ from SMP's:

* batches: SMP's per-rank batch B split into ``microbatches`` M becomes ``train_micro_batch_size_per_gpu`` B / M and
  ``gradient_accumulation_steps`` M over DeepSpeed's data-parallel size (world / tensor-parallel degree);
  with tensor parallelism and without ``prescaled_batch`` SMP's tensor-parallel ranks read their own rows, so a
  tensor-parallel group feeds tp x B rows (identical on its ranks: AutoTP needs the same input there);
* sharded data parallelism S over N ranks (MiCS, which DeepSpeed >= 0.19.7 no longer has) becomes ZeRO-3 with
  ``zero_hpz_partition_size`` S (ZeRO++'s hierarchical partitioning): parameters are gathered inside groups of S as
  MiCS did, but gradients and optimizer state are sharded over all N ranks (same training, other memory and
  traffic); S = N is plain ZeRO-3;
* ``shard_optimizer_state`` is ZeRO stage 1; precision and gradient clipping are the plan's;
* tensor parallelism is DeepSpeed's AutoTP (``tensor_parallel.autotp_size``), which refuses some families by name
  (DeepSpeed 0.19's ``AutoTP.supported``): with ``--model`` such a family is refused here with the route that works;
* pipelines are refused: DeepSpeed's ``PipelineModule`` needs the model written as a layer list.

Pure: the Plan in, a dict and notes out.
"""

from __future__ import annotations

from typing import Any

from smp2ds.translator.issues import Issue, SMPConfigError
from smp2ds.translator.plan_types import Plan

AUTOTP_REFUSED = ("deberta", "flaubert", "fsmt", "gpt2", "led", "longformer", "xlm", "xlnet")
"""Model families DeepSpeed 0.19's AutoTP refuses (``AutoTP.supported``: "AutoTP not supported for model")."""

_KEPT = ("gradient_clipping", "fp16", "bf16", "zero_allow_untested_optimizer", "steps_per_print")


def native_config(plan: Plan, model_type: str | None = None, pipelines_by_hand: bool = False,
                  unknown_family: str = "give --model-type to check",
                  batch_from_trainer: bool = False) -> tuple[dict[str, Any], list[str]]:
    """(the DeepSpeed config, the notes on what differs from SMP) for ``plan`` (its per-rank batch: ``--batch-size``
    or the hyperparameters). Raises :class:`SMPConfigError` naming the key for what native DeepSpeed cannot run as
    SMP did. ``pipelines_by_hand``: a pipeline is not refused (``smp2ds port`` marks it for a person) and the config
    covers the rest of the layout. ``unknown_family``: what the AutoTP note tells a user whose family is not known.
    ``batch_from_trainer``: a Hugging Face Trainer sets the batch keys (``trainer_deepspeed``), so the config has
    none and an unknown per-rank batch is no error.
    """
    topo, settings = plan.topology_settings, plan.engine_settings
    batch_size = settings.batch.per_rank_batch
    issues = []
    if topo.pipeline_parallel_degree > 1 and not pipelines_by_hand:
        issues.append(Issue("/pipeline_parallel_degree", f"pipeline_parallel_degree {topo.pipeline_parallel_degree}: "
                            "a plain DeepSpeed script runs pipelines only through deepspeed.pipe.PipelineModule, "
                            "which needs the model written as a layer list",
                            hint="keep running the script with smp2ds launch, or `smp2ds port` it and write the "
                                 "PipelineModule by hand"))
    tp = topo.tensor_parallel_degree
    if tp > 1 and model_type is not None and model_type.lower() in AUTOTP_REFUSED:
        issues.append(Issue("/tensor_parallel_degree", f"tensor_parallel_degree {tp}: DeepSpeed's AutoTP refuses "
                            f"the {model_type} family ('AutoTP not supported for model')",
                            hint="export the weights (`smp2ds checkpoint export --to hf`) and train that model with "
                                 "data or sharded data parallelism (tensor_parallel_degree 1), or under accelerate "
                                 "(convert --to accelerate) if it has a tp_plan"))
    if batch_size is None and not batch_from_trainer:
        issues.append(Issue("/microbatches", "a native DeepSpeed config needs its batch sizes: the per-rank batch is "
                            "not known", hint="give --batch-size B (the batch each rank's script feeds one step)"))
    if issues:
        raise SMPConfigError(issues)
    config: dict[str, Any] = {k: plan.deepspeed[k] for k in _KEPT if k in plan.deepspeed}
    notes = [] if batch_size is None or batch_from_trainer else _batch(plan, batch_size, config)
    return config, notes + _layout(plan, config, model_type, unknown_family)


def _batch(plan: Plan, batch_size: int, config: dict[str, Any]) -> list[str]:
    """Add the batch keys for SMP's per-rank ``batch_size`` to ``config``; the note saying how they were counted."""
    topo, settings = plan.topology_settings, plan.engine_settings
    tp = topo.tensor_parallel_degree
    micro_batches = settings.batch.microbatches
    prescaled = settings.batch.prescaled_batch
    rows = batch_size * (tp if tp > 1 and not prescaled else 1)  # what one DeepSpeed data-parallel rank feeds
    if rows % micro_batches:
        raise SMPConfigError([Issue("/microbatches", f"the per-rank batch {rows} does not split into "
                                    f"{micro_batches} micro-batches", hint="choose a batch size they divide")])
    dp = topo.world_size // (tp * topo.pipeline_parallel_degree)
    # DeepSpeed (0.19.8) checks train_batch_size against every rank when AutoTP comes from the config alone: its
    # tensor-parallel ranks count as data-parallel ones there, though they feed the same rows
    counted = dp * tp
    micro = rows // micro_batches
    config.update({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": micro_batches,
                   "train_batch_size": micro * micro_batches * counted})
    notes = [f"batch: SMP's per-rank batch {batch_size} in {micro_batches} micro-batch(es) -> "
             f"train_micro_batch_size_per_gpu {micro} x gradient_accumulation_steps {micro_batches} over "
             f"DeepSpeed's data-parallel size {dp}: train_batch_size {micro * micro_batches * counted}"
             + (f" (DeepSpeed counts the {tp} AutoTP ranks of a group in its batch check, though they share rows)"
                if tp > 1 else "")]
    return notes


def _layout(plan: Plan, config: dict[str, Any], model_type: str | None, unknown_family: str) -> list[str]:
    """Add ZeRO and AutoTP to ``config``; the notes on what differs from SMP."""
    topo, settings = plan.topology_settings, plan.engine_settings
    tp, notes = topo.tensor_parallel_degree, []
    prescaled = settings.batch.prescaled_batch
    rows_note = ("" if prescaled or settings.batch.per_rank_batch is None else
                 f"; each tensor-parallel group feeds {settings.batch.per_rank_batch * tp} identical rows (SMP's "
                 "tensor-parallel ranks read their own rows without prescaled_batch)")
    stage = settings.zero_stage
    zero: dict[str, Any] = {"stage": stage}
    sdp = topo.sharded_data_parallel_degree
    if sdp > 1:
        zero["stage"] = 3
        if sdp < topo.rdp_degree:
            zero["zero_hpz_partition_size"] = sdp
            notes.append(f"sharded_data_parallel_degree {sdp} over {topo.rdp_degree} ranks (MiCS, gone from "
                         f"DeepSpeed >= 0.19.7) -> ZeRO-3 with zero_hpz_partition_size {sdp}: parameters gathered "
                         f"within groups of {sdp} as MiCS did, gradients and optimizer state sharded over all "
                         f"{topo.rdp_degree} (same training; other memory per rank and traffic)")
        else:
            notes.append(f"sharded_data_parallel_degree {sdp} over all {topo.rdp_degree} ranks -> plain ZeRO-3")
    config["zero_optimization"] = zero
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
        notes.append(f"tensor_parallel_degree {tp} -> DeepSpeed AutoTP (tensor_parallel.autotp_size {tp})"
                     + ("" if model_type else f"; AutoTP refuses {', '.join(AUTOTP_REFUSED)}: {unknown_family}")
                     + rows_note)
    if topo.pipeline_parallel_degree > 1:
        notes.append(f"pipeline_parallel_degree {topo.pipeline_parallel_degree} is left for a person: DeepSpeed's "
                     "PipelineModule needs the model as a layer list; this config covers the rest of the layout")
    if stage == 1 and sdp <= 1:
        notes.append("shard_optimizer_state -> ZeRO stage 1")
    if zero["stage"] == 0:
        notes.append("ZeRO stage 0: DeepSpeed loads a universal checkpoint (load_universal) into ZeRO stages 1 to 3 "
                     "only: to continue an exported checkpoint, set zero_optimization.stage 1 (same training)")
    return notes
