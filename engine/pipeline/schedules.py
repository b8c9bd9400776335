"""Training schedules for DeepSpeed's `PipelineEngine`, without the optimizer step.

SMP calls ``optimizer.step()`` outside the ``@smp.step`` function, so a step schedule here ends
with the gradient reductions the caller asks for (``reduce``) and leaves ``OptimizerStep`` to the
runner. Two schedules:

* `OneFOneBSchedule`: DeepSpeed's own `TrainSchedule` (1F1B) minus ``OptimizerStep``.
* `GPipeSchedule`: all forwards, then all backwards (SMP ``pipeline: simple``), optionally over
  groups of ``group_size`` micro-batches so no more than that many are in flight.

Deadlock freedom of GPipe with blocking point-to-point sends: in the forward phase activations
flow only from stage s to s+1 in micro-batch order, in the backward phase gradients flow only
from s+1 to s in the same order, and every stage issues its sends and receives in that order,
so the last stage can always make progress and, by induction, so can every other stage.
"""

from __future__ import annotations

from collections.abc import Iterator

from deepspeed.runtime.pipe import schedule as ds_schedule

REDUCE_ALL = "all"
"""Tied-weight gradient all-reduce, then the data-parallel gradient reduction."""
REDUCE_TIED = "tied"
"""Only the tied-weight all-reduce (one data-parallel rank and a plain optimizer: DeepSpeed's
data-parallel reduction would only flatten and copy every gradient)."""
REDUCE_NONE = "none"
"""No reduction: a step inside a gradient-accumulation window spanning several steps."""


def _reductions(reduce: str) -> list:
    if reduce == REDUCE_ALL:
        return [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads()]
    if reduce == REDUCE_TIED:
        return [ds_schedule.ReduceTiedGrads()]
    if reduce == REDUCE_NONE:
        return []
    raise ValueError(f"reduce must be 'all', 'tied' or 'none', got {reduce!r}")


class OneFOneBSchedule(ds_schedule.TrainSchedule):
    """DeepSpeed's 1F1B `TrainSchedule`; the optimizer step is left to the caller.

    The reductions DeepSpeed issues at the end of the last step are replaced by ``reduce``'s.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, reduce: str = REDUCE_ALL):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.reductions = _reductions(reduce)

    def steps(self) -> Iterator[list]:
        drop = (ds_schedule.OptimizerStep, ds_schedule.ReduceGrads, ds_schedule.ReduceTiedGrads)
        for cmds in super().steps():
            kept = [c for c in cmds if not isinstance(c, drop)]
            yield kept + self.reductions if len(kept) < len(cmds) else kept


class GPipeSchedule(ds_schedule.PipeSchedule):
    """All forwards, then all backwards, over groups of ``group_size`` micro-batches."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, group_size: int | None = None,
                 reduce: str = REDUCE_ALL):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.group_size = max(1, min(group_size or micro_batches, micro_batches))
        self.reductions = _reductions(reduce)

    def num_pipe_buffers(self) -> int:
        # One buffer per micro-batch of a group: the activations of every forward in the group
        # are kept until its backward runs.
        return self.group_size

    def steps(self) -> Iterator[list]:
        for start in range(0, self.micro_batches, self.group_size):
            group = range(start, min(start + self.group_size, self.micro_batches))
            for mb in group:
                yield self._forward(mb)
            for mb in group:
                yield self._backward(mb)
        if self.reductions:
            yield list(self.reductions)

    def _forward(self, mb: int) -> list:
        buf = self._buffer_idx(mb)
        cmds: list = []
        if self.is_first_stage or self.is_last_stage:
            cmds.append(ds_schedule.LoadMicroBatch(buf))
        if not self.is_first_stage:
            cmds.append(ds_schedule.RecvActivation(buf))
        cmds.append(ds_schedule.ForwardPass(buf))
        if not self.is_last_stage:
            cmds.append(ds_schedule.SendActivation(buf))
        return cmds

    def _backward(self, mb: int) -> list:
        buf = self._buffer_idx(mb)
        cmds: list = []
        if not self.is_last_stage:
            cmds.append(ds_schedule.RecvGrad(buf))
        cmds.append(ds_schedule.BackwardPass(buf))
        if not self.is_first_stage:
            cmds.append(ds_schedule.SendGrad(buf))
        return cmds


def make_train_schedule(kind: str, micro_batches: int, stages: int, stage_id: int, group_size: int,
                        reduce: str = REDUCE_ALL) -> ds_schedule.PipeSchedule:
    """The schedule object for one training step (``kind`` from `settings.ScheduleChoice`)."""
    if kind == "1f1b":
        return OneFOneBSchedule(micro_batches, stages, stage_id, reduce=reduce)
    if kind == "gpipe":
        return GPipeSchedule(micro_batches, stages, stage_id, group_size=group_size, reduce=reduce)
    raise ValueError(f"unknown pipeline schedule kind {kind!r}; expected '1f1b' or 'gpipe'")


def make_eval_schedule(micro_batches: int, stages: int, stage_id: int) -> ds_schedule.PipeSchedule:
    """Forward-only schedule for steps run after ``model.eval()``."""
    return ds_schedule.InferenceSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
