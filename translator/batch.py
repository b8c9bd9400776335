"""Batch arithmetic: SMP's per-rank batch and ``microbatches`` -> DeepSpeed's batch triple.

SMP semantics (docs/smp-semantics.md#batches): the tensors handed to an ``@smp.step`` function are this
rank's batch B; smp.step splits it into ``microbatches`` m pieces and accumulates gradients, so
the SMP micro-batch is B/m and DeepSpeed's ``gradient_accumulation_steps`` is m.

Which data-parallel size DeepSpeed checks ``train_batch_size`` against
(``train_batch_size == micro * GAS * dp``, DeepSpeed ``runtime/config.py``):

* plain data parallelism, ZeRO-1 and pipelines: the reduced-data-parallel degree ``rdp``
  (tensor-parallel peers are DeepSpeed's model-parallel axis, pipeline stages its pipe axis);
* sharded data parallelism (S > 1): S, because the engine hands DeepSpeed the shard group as its
  data-parallel group; the replica all-reduce across the R = dp/S groups is the engine's. The
  job's real global batch is therefore reported separately (``global_batch_size``).

Tensor parallelism with ``prescaled_batch`` false (SMP's default): every tensor-parallel rank
brings its own batch, and SMP's layers concatenate the group's batches ([B,...] -> [tp*B,...]).
DeepSpeed AutoTP and Megatron require all ranks of a tensor-parallel group to see the same data,
so the engine gathers the group's inputs and DeepSpeed's micro-batch is tp x B/m. The global batch
is dp x B either way; with ``prescaled_batch`` true the group shares one batch and it is rdp x B.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class BatchPlan:
    """Batch sizes of one plan; sizes are None when the per-rank batch is unknown."""

    per_rank_batch: int | None
    """B: samples handed to the @smp.step function on one rank."""
    microbatches: int
    """m: smp.step splits B into m micro-batches (DeepSpeed gradient_accumulation_steps)."""
    micro_batch: int | None
    """B/m: SMP's micro-batch on one rank."""
    deepspeed_micro_batch: int | None
    """DeepSpeed's train_micro_batch_size_per_gpu (tp x B/m when the engine gathers TP inputs)."""
    deepspeed_data_parallel_size: int
    """The data-parallel world size DeepSpeed's batch check uses (rdp, or S with sharding)."""
    train_batch_size: int | None
    """DeepSpeed's train_batch_size = micro x GAS x deepspeed_data_parallel_size."""
    global_batch_size: int | None
    """Samples per optimizer step across the whole job."""
    tp_input_gather: bool
    """True when the engine gathers the tensor-parallel group's batches (prescaled_batch false, tp > 1)."""

    def deepspeed_keys(self) -> dict[str, int]:
        """The DeepSpeed batch keys; only accumulation when the batch is unknown."""
        if self.deepspeed_micro_batch is None or self.train_batch_size is None:
            return {"gradient_accumulation_steps": self.microbatches}
        return {
            "train_batch_size": self.train_batch_size,
            "train_micro_batch_size_per_gpu": self.deepspeed_micro_batch,
            "gradient_accumulation_steps": self.microbatches,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class BatchSettings(BatchPlan):
    """The Plan's ``/engine/batch``: the batch sizes plus where the per-rank batch came from."""

    prescaled_batch: bool = False
    """SMP's ``prescaled_batch``: the tensor-parallel group shares one batch."""
    source: str | None = None
    """Where the per-rank batch size came from (a layout flag or hyperparameter); None when unknown."""

    @classmethod
    def of(cls, batch: BatchPlan, *, prescaled_batch: bool, source: str | None) -> BatchSettings:
        """``batch`` with the two plan-level facts added."""
        return cls(**asdict(batch), prescaled_batch=prescaled_batch, source=source)


def divisibility_problem(per_rank_batch: int | None, microbatches: int) -> str | None:
    """Why B cannot be split into m micro-batches (smp.step's TensorSplitError), or None."""
    if per_rank_batch is None or per_rank_batch % microbatches == 0:
        return None
    return (
        f"the per-rank batch size {per_rank_batch} is not divisible by microbatches({microbatches}): "
        f"{per_rank_batch} % {microbatches} = {per_rank_batch % microbatches}"
    )


def plan_batch(
    *,
    per_rank_batch: int | None,
    microbatches: int,
    tp: int,
    rdp: int,
    shard_size: int = 1,
    prescaled_batch: bool = False,
) -> BatchPlan:
    """Batch sizes for a layout; call :func:`divisibility_problem` first (this one truncates nothing)."""
    problem = divisibility_problem(per_rank_batch, microbatches)
    if problem:
        raise ValueError(problem)
    gather = tp > 1 and not prescaled_batch
    ds_dp = shard_size if shard_size > 1 else rdp
    if per_rank_batch is None:
        return BatchPlan(None, microbatches, None, None, ds_dp, None, None, gather)
    micro = per_rank_batch // microbatches
    ds_micro = micro * tp if gather else micro
    global_batch = per_rank_batch * rdp * (1 if prescaled_batch else tp)
    return BatchPlan(
        per_rank_batch=per_rank_batch,
        microbatches=microbatches,
        micro_batch=micro,
        deepspeed_micro_batch=ds_micro,
        deepspeed_data_parallel_size=ds_dp,
        train_batch_size=ds_micro * microbatches * ds_dp,
        global_batch_size=global_batch,
        tp_input_gather=gather,
    )
