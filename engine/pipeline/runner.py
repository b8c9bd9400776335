"""`PipelineRunner`: one model split over pipeline stages on DeepSpeed's `PipelineEngine`.

How an ``@smp.step`` function runs here (the function calls ``model(...)`` once and
``model.backward(loss)``, as in SMP):

1. First stage, *capture*: the function runs once per micro-batch until it calls the model; the
   call's arguments become that micro-batch's input tensors (`ModelAdapter.pipe_inputs`) and
   the function is abandoned there (nothing after the model call runs on this stage).
2. DeepSpeed executes the schedule (1F1B or GPipe, `schedules`); activations and gradients move
   between stages as tensors.
3. Last stage, *loss*: for each micro-batch DeepSpeed asks for the loss; the runner runs the
   function once more with that micro-batch's arguments, ``model(...)`` returning the real
   output (`ModelAdapter.make_output`, e.g. a Hugging Face output whose ``loss`` comes from
   ``labels``), and ``model.backward(loss)`` only *recording* the loss, which DeepSpeed then
   backpropagates (scaled by 1/microbatches, SMP's ``average_grads_across_microbatches``).
4. The function's return values and the losses are broadcast from the last stage to every rank
   of the pipeline, so ``StepOutput`` is the same on all of them.

Consequences (documented limits): one model call per step function; code after ``model(...)``
runs only on the last stage and code before it on the first and last stage; gradients are not
visible inside the step function (the backward pass runs later, in the schedule). As in SMP,
the step runs with the *first stage's* arguments: scripts may load data on ``pp_rank 0`` only and
pass dummies elsewhere; the first stage sends its micro-batches to the other stages of its
pipeline (`step_inputs`), which use their own arguments only for objects that are not sent
(the model, an optimizer). Shard data by ``dp_rank`` (SMP's rule).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from smp2ds.engine.exceptions import BwdExecutionNotInStepFnError, FwdExecutionNotInStepFnError, SMPRuntimeError
from smp2ds.engine.pipeline import stage_collectives as collectives
from smp2ds.engine.pipeline import stage_state_dict, step_inputs
from smp2ds.engine.pipeline.ds_topology import to_ds_topology
from smp2ds.engine.pipeline.layers import LayerList, build_layer_list
from smp2ds.engine.pipeline.module import PlannedPipelineModule
from smp2ds.engine.pipeline.partition_plan import PartitionPlan, plan_partition
from smp2ds.engine.pipeline.schedules import (
    REDUCE_ALL,
    REDUCE_NONE,
    REDUCE_TIED,
    make_eval_schedule,
    make_train_schedule,
)
from smp2ds.engine.pipeline.settings import PipelineSettings
from smp2ds.translator.topology import Topology

log = logging.getLogger("smp2ds.pipeline")

MicroCall = tuple[tuple, dict]


class _Captured(BaseException):
    """Raised by the model call during capture; BaseException so user ``except Exception`` passes it."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("captured")
        self.args, self.kwargs = args, kwargs


class PipelineRunner:
    """Runs one model as pipeline stages; create it with `build_pipeline`."""

    def __init__(self, model: nn.Module, settings: PipelineSettings, topology: Topology, ds_config: dict,
                 layer_list: LayerList | None = None):
        import deepspeed.comm as ds_comm

        initialised, rank, world, backend = collectives.process_info()
        if not initialised:
            raise SMPRuntimeError("pipeline parallelism needs torch.distributed initialised (smp.init does it)")
        if topology.world_size != world:
            raise SMPRuntimeError(f"topology describes {topology.world_size} ranks but the world has {world}")
        if "LOCAL_RANK" not in os.environ:
            # DeepSpeed's PipelineModule reads it to pick the device.
            raise SMPRuntimeError("LOCAL_RANK is not set: launch with deepspeed, torchrun or mpirun via smp2ds "
                                  "launch, or set it (the process's index on its node)")
        ds_comm.init_distributed(dist_backend=backend, dist_init_required=False, verbose=False)
        self.model, self.settings, self.topology = model, settings, topology
        self.ds_config = dict(ds_config)
        self.layer_list = layer_list or build_layer_list(model)
        self.partition: PartitionPlan = plan_partition(
            self.layer_list, settings.pp, auto=settings.auto_partition, memory_weight=settings.memory_weight,
            default_partition=settings.default_partition)
        if rank == 0:
            log.info("%s", self.partition.describe())
        self._names = stage_state_dict.StateNames(model, self.layer_list.buffer_slots)
        self.module = PlannedPipelineModule(self.layer_list.entries, self.partition.parts,
                                            to_ds_topology(topology), loss_fn=self._loss_fn)
        self.stage = self.module.stage_id
        self.is_first_stage = self.stage == 0
        self.is_last_stage = self.stage == settings.pp - 1
        self.training = True
        self.engine: Any = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._mode: str | None = None
        self._shape_key: Any = None
        self.last_losses: list[torch.Tensor | None] = []
        self._arrival = step_inputs.InputsInFlight([])
        self.before_reduce: Callable[[list[nn.Parameter]], None] | None = None
        """Called with this stage's parameters before the gradient reductions of a step (tensor
        parallelism combines the group's per-rank gradients there)."""
        self.on_engine_built: Callable[[Any], None] | None = None
        """Called with DeepSpeed's pipeline engine once it exists (its optimizer decides how tensor
        parallelism corrects gradients)."""
        self.full_tensor: stage_state_dict.TensorMap | None = None
        """Maps a local tensor to the whole one in ``state_dict()`` (tensor-parallel shards)."""
        self.local_part: stage_state_dict.CutMap | None = None
        """Cuts a loaded value to this rank's part in ``load_state_dict`` (tensor-parallel shards)."""

    # ---- what DistributedModel delegates to ---------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model call inside a step function (see the module docstring)."""
        if self._mode == "capture":
            raise _Captured(args, kwargs)
        if self._mode == "loss":
            self._calls += 1
            if self._calls > 1:
                raise SMPRuntimeError("a pipelined model can be called only once per @smp.step function")
            return self.layer_list.adapter.make_output(self._pipe_output, args, kwargs)
        raise FwdExecutionNotInStepFnError(
            "with pipeline_parallel_degree > 1 the model can only be called inside an @smp.step function")

    def backward(self, loss: torch.Tensor, grad_tensors: Any = None) -> None:
        """``model.backward(loss)`` inside a step function: records the loss DeepSpeed backpropagates."""
        if self._mode != "loss":
            raise BwdExecutionNotInStepFnError("model.backward must be called inside an @smp.step function")
        if grad_tensors is not None:
            raise SMPRuntimeError("model.backward(loss, grad_tensors) is not supported with pipeline parallelism; "
                                  "pass a scalar loss")
        if self._loss is not None:
            raise SMPRuntimeError("model.backward was called twice in one step function")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise SMPRuntimeError(f"model.backward needs a scalar loss tensor, got {type(loss).__name__}")
        self._loss = loss

    def train(self, mode: bool = True) -> PipelineRunner:
        self.training = mode
        self.module.train(mode)
        return self

    def eval(self) -> PipelineRunner:
        return self.train(False)

    # ---- optimizer ----------------------------------------------------------------------------
    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Keep only this stage's parameters in ``optimizer`` (in place) and use it for training.

        SMP scripts build the optimizer from all parameters before the first step; a stage owns
        only some. Param groups stay (possibly empty) so LR schedulers keep their group count.
        """
        if self.engine is not None:
            raise SMPRuntimeError("the optimizer must be attached before the first step")
        local = {id(p) for p in self.module.parameters()}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in local]
        for p in [p for p in optimizer.state if id(p) not in local]:
            del optimizer.state[p]
        self._optimizer = optimizer
        return optimizer

    @property
    def optimizer(self) -> Any:
        """The optimizer DeepSpeed steps (its ZeRO-1 wrapper when ``shard_optimizer_state``)."""
        return self.engine.optimizer if self.engine is not None else self._optimizer

    def optimizer_step(self) -> None:
        """``optimizer.step()`` outside the step function: clip, step, zero grads (DeepSpeed's own)."""
        if self.engine is None:
            raise SMPRuntimeError("optimizer.step() before the first training step")
        self.engine._exec_optimizer_step()

    def zero_grad(self) -> None:
        """``optimizer.zero_grad()``: drop this stage's gradients (and ZeRO-1's reduced copies)."""
        for p in self.module.parameters():
            p.grad = None
        if self.engine is not None and self.engine.zero_optimization():
            self.engine.optimizer.zero_grad()

    # ---- the step -----------------------------------------------------------------------------
    def run_step(self, fn: Callable[..., Any], micro_calls: Sequence[MicroCall], *,
                 reduce_grads: bool = True) -> list[Any]:
        """Run ``fn`` over the micro-batches; return its per-micro-batch results on every stage.

        ``micro_calls[i] = (args, kwargs)`` for micro-batch ``i`` (smp.step splits the inputs).
        ``reduce_grads=False`` skips the gradient all-reduces (inside an accumulation window).
        Training (1F1B/GPipe, with backward) when the runner is in train mode and grad is
        enabled; otherwise a forward-only schedule.
        """
        m = len(micro_calls)
        if m != self.settings.microbatches:
            raise SMPRuntimeError(f"got {m} micro-batches, the pipeline was configured for "
                                  f"microbatches={self.settings.microbatches}")
        training = self.training and torch.is_grad_enabled()
        if training and self._optimizer is None and self.engine is None:
            raise SMPRuntimeError("create smp.DistributedOptimizer(...) before the first training step")
        self._arrival = self._inputs_from_first_stage(micro_calls)
        try:
            self._run_schedule(fn, self._arrival.calls, training, reduce_grads)
        finally:
            self._arrival.wait()  # before the next collective on the pipeline group
        engine = self.engine
        src = engine.grid.stage_to_global(self.settings.pp - 1)
        payload = (self._results, self._losses) if self.is_last_stage else None
        results, losses = collectives.broadcast_object(payload, src, self._pipe_group())
        if self.is_last_stage:
            results, losses = self._results, self._losses
        else:  # arrived on CPU; SMP hands step outputs back on the rank's device
            results, losses = collectives.map_tensors((results, losses), lambda t: t.to(engine.device))
        self.last_losses = list(losses)
        return list(results)

    def _run_schedule(self, fn: Callable[..., Any], micro_calls: list[MicroCall], training: bool,
                      reduce_grads: bool) -> None:
        m = len(micro_calls)
        self._ensure_engine(micro_calls)
        if not self.is_first_stage and self.engine.device != collectives.tensor_device(self._pipe_group()):
            self._arrival.wait()
            micro_calls = collectives.map_tensors(micro_calls, lambda t: t.to(self.engine.device))
        self._reset_shapes_if_changed(micro_calls)
        inputs = [self._capture(fn, a, k) for a, k in micro_calls] if self.is_first_stage else [None] * m
        self._fn, self._calls_in, self._training = fn, list(micro_calls), training
        self._results: list[Any] = [None] * m
        self._losses: list[torch.Tensor | None] = [None] * m
        engine = self.engine
        engine.set_dataiterator(iter([(inputs[i], torch.tensor([i])) for i in range(m)]))
        engine.module.train(training)
        engine.total_loss = None
        engine._compute_loss = True
        if training:
            kind, group = self.settings.schedule.kind, self.settings.schedule.group_size
            engine._exec_schedule(make_train_schedule(kind, m, self.settings.pp, self.stage, group,
                                                      self._reduction(reduce_grads)))
        else:
            with torch.no_grad():
                engine._exec_schedule(make_eval_schedule(m, self.settings.pp, self.stage))

    def _pipe_group(self) -> Any:
        """This stage's pipeline group (DeepSpeed's grid, which the engine shares as ``engine.grid``)."""
        return self.module.mpu().get_pipe_parallel_group()

    def _inputs_from_first_stage(self, micro_calls: Sequence[MicroCall]) -> step_inputs.InputsInFlight:
        """SMP runs a step with the first stage's inputs: the other stages receive its micro-batches."""
        return step_inputs.from_first_stage(micro_calls, is_first=self.is_first_stage,
                                            src=self.module.mpu().stage_to_global(0), group=self._pipe_group())

    def _reduction(self, reduce_grads: bool) -> str:
        if not reduce_grads:
            return REDUCE_NONE
        e = self.engine
        # With one data-parallel rank DeepSpeed's reduction of a plain optimizer's gradients is a
        # no-op that still flattens and copies them; ZeRO and fp16/bf16 wrappers need the call.
        plain = not (e.zero_optimization() or e.fp16_enabled() or e.bfloat16_enabled())
        return REDUCE_TIED if plain and self.topology.rdp == 1 else REDUCE_ALL

    def _capture(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._mode = "capture"
        try:
            fn(*args, **kwargs)
        except _Captured as call:
            return self.layer_list.adapter.pipe_inputs(call.args, call.kwargs)
        finally:
            self._mode = None
        raise SMPRuntimeError("the @smp.step function returned without calling the model")

    def _loss_fn(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``loss_fn`` on the last stage: run the step function for one micro-batch."""
        index = int(labels.reshape(-1)[0])
        self._arrival.wait()  # the received inputs are read from here on
        args, kwargs = self._calls_in[index]
        self._mode, self._pipe_output, self._loss, self._calls = "loss", outputs, None, 0
        try:
            result = self._fn(*args, **kwargs)
        finally:
            self._mode, self._pipe_output = None, None
        if self._calls == 0:
            raise SMPRuntimeError("the @smp.step function returned without calling the model")
        self._results[index] = collectives.detach(result)
        loss = self._loss
        if self._training:
            if loss is None:
                raise SMPRuntimeError("a training step must call model.backward(loss); for evaluation call "
                                      "model.eval() (or use torch.no_grad()) before the step")
            self._losses[index] = loss.detach()
            return loss
        self._losses[index] = None if loss is None else loss.detach()
        return torch.zeros((), device=outputs_device(outputs)) if loss is None else loss.detach()

    def _ensure_engine(self, micro_calls: Sequence[MicroCall]) -> None:
        if self.engine is not None:
            return
        import deepspeed

        micro = _micro_batch_size(micro_calls)
        cfg = dict(self.ds_config)
        cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=self.settings.microbatches,
                   train_batch_size=micro * self.settings.microbatches * self.topology.rdp)
        cfg.setdefault("steps_per_print", 2 ** 31 - 1)
        self.engine, *_ = deepspeed.initialize(model=self.module, optimizer=self._optimizer, config=cfg)
        self._wrap_instructions(self.engine)
        if self.on_engine_built is not None:
            self.on_engine_built(self.engine)

    def _wrap_instructions(self, engine: Any) -> None:
        """Make the last stage backpropagate each buffer's own loss, and run ``before_reduce``.

        DeepSpeed's last stage backpropagates ``engine.loss``, the loss of the *latest* forward:
        right for 1F1B (each forward is followed by its backward), wrong for GPipe (all forwards
        first). Wrapping the forward/backward instructions of this engine instance records the
        loss per pipe buffer and restores it before that buffer's backward, and lets go of the
        buffer's outputs once their backward is done. Every reducing
        schedule starts its reductions with ``ReduceTiedGrads`` (`schedules`): ``before_reduce``
        runs just before it.
        """
        from deepspeed.runtime.pipe import schedule as ds_schedule
        from deepspeed.runtime.pipe.engine import PipelineEngine

        by_buffer: dict[int, Any] = {}
        runner = self

        def forward(eng: Any, buffer_id: int) -> None:
            PipelineEngine._exec_forward_pass(eng, buffer_id)
            if runner.is_last_stage:
                by_buffer[buffer_id] = eng.loss

        def backward(eng: Any, buffer_id: int) -> None:
            if runner.is_last_stage:
                eng.loss = by_buffer.pop(buffer_id)
            PipelineEngine._exec_backward_pass(eng, buffer_id)
            if runner.is_last_stage:
                # DeepSpeed's last stage keeps the buffer's outputs (the logits) after their backward until the
                # next forward into that buffer has made its own: one micro-batch's logits too many at the
                # stage's peak. Nothing reads them after the backward.
                eng.pipe_buffers["outputs"][buffer_id] = None

        def reduce_tied(eng: Any) -> None:
            if runner.before_reduce is not None:
                runner.before_reduce(list(runner.module.parameters()))
            PipelineEngine._exec_reduce_tied_grads(eng)

        table = dict(type(engine)._INSTRUCTION_MAP)
        table[ds_schedule.ForwardPass] = forward
        table[ds_schedule.BackwardPass] = backward
        table[ds_schedule.ReduceTiedGrads] = reduce_tied
        engine._INSTRUCTION_MAP = table  # instance attribute: shadows the class table for this engine only

    def _reset_shapes_if_changed(self, micro_calls: Sequence[MicroCall]) -> None:
        # Every rank of the pipeline sees the same step arguments, so each can tell on its own
        # that the activation shapes may change and drop DeepSpeed's cached buffers in step.
        key = tuple((tuple(t.shape), t.dtype) for t in _tensors(micro_calls[0]))
        if self._shape_key is not None and key != self._shape_key:
            self.engine.reset_activation_shape()
        self._shape_key = key

    # ---- state --------------------------------------------------------------------------------
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters and buffers under the original model's keys (CPU copies)."""
        return stage_state_dict.local_state_dict(self._names, self.module)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model (every stage's part) on every rank of this pipeline; collective over it
        (and over the tensor-parallel group when ``full_tensor`` joins shards)."""
        local = stage_state_dict.local_state_dict(self._names, self.module, self.full_tensor)
        parts = collectives.all_gather_objects(local, self._pipe_group())
        return stage_state_dict.merge(parts)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> list[str]:
        """Load the entries this stage holds (from a full or a per-stage dict); keys loaded."""
        loaded = stage_state_dict.load_local(self._names, self.module, state_dict, strict=strict, cut=self.local_part)
        opt = self.engine.optimizer if self.engine is not None else None
        if opt is not None and hasattr(opt, "refresh_fp32_params"):
            opt.refresh_fp32_params()  # ZeRO keeps fp32 master copies of the weights
        return loaded

    def local_named_parameters(self, include_replicas: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """``(original name, parameter)`` for the parameters this stage holds, each once.

        A tied weight is held by the first and the last stage; DeepSpeed marks the later copies
        ``ds_pipe_replicated``. ``include_replicas=False`` skips them, so summing over the stages
        (e.g. a gradient norm) counts every weight once.
        """
        seen: set[int] = set()
        for key, t in self._names.local_tensors(self.module):
            if not isinstance(t, nn.Parameter) or id(t) in seen:
                continue
            seen.add(id(t))
            if include_replicas or not getattr(t, "ds_pipe_replicated", False):
                yield key, t

    def local_modules(self) -> list[nn.Module]:
        """The original modules whose layers run on this stage."""
        start, stop = self.partition.parts[self.stage], self.partition.parts[self.stage + 1]
        return [m for layer in self.layer_list.layers[start:stop] for m in layer.owners]


def outputs_device(outputs: Any) -> torch.device:
    for t in _tensors(((outputs,), {})):
        return t.device
    return torch.device("cpu")


def _tensors(call: MicroCall) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    collectives.map_tensors(list(call[0]) + list(call[1].values()), lambda t: found.append(t))
    return found


def _micro_batch_size(micro_calls: Sequence[MicroCall]) -> int:
    tensors = _tensors(micro_calls[0])
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1
