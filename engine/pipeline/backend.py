"""The pipeline backend: ``DistributedModel`` on DeepSpeed's pipeline engine.

The pipeline runner owns the micro-batch loop (DeepSpeed's pipeline schedule), the model call
and the recorded loss; this backend maps the SMP objects' calls onto it. Loss scale, clipping and
optimizer state go through :mod:`smp2ds.engine.core.deepspeed_optimizer`, as for data parallelism
(DeepSpeed's optimizer wrappers are the same); the engine cannot be rebuilt around new parameter
groups (``can_rebuild_optimizer`` is False).

With tensor parallelism the backend factory hands it the model ``parallelize`` sharded before the cut
(each stage's blocks are then tensor-parallel regions over the stage's group). DeepSpeed's ``PipelineEngine``
runs on the SMP layout's ``ProcessTopology`` (axes pipe/data/model): activations travel between the ranks
of the same tensor-parallel and data-parallel coordinates, and its gradient reduction runs over the data
axis, the reduced-data-parallel group. The view's gradient correction runs before the step's reductions
(or per micro-batch by hooks, with DeepSpeed's bf16 optimizer), ``state_dict()`` joins shards, loading cuts
whole tensors, and the gradient norm counts shards once per group. DeepSpeed's ``pipe_partitioned`` /
``grad_partitioned`` stay off: with ``prescaled_batch: false`` every tensor-parallel rank's activations are
its own rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.core import deepspeed_optimizer as dso
from smp2ds.engine.core.deepspeed_config import LossScaleArgs, fp16_block, precision, zero_stage
from smp2ds.engine.core.process_groups import ProcessGroups
from smp2ds.engine.core.tensor_parallel_view import TensorParallelView
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.translator.plan_types import Plan


class PipelineBackend:
    """``pipeline_parallel_degree`` stages on DeepSpeed's ``PipelineEngine`` (via ``PipelineRunner``)."""

    name = "pipeline"
    cast_io = False
    """DeepSpeed's pipeline engine casts the stages' inputs itself."""
    collective_state_dict = False
    can_rebuild_optimizer = False
    """DeepSpeed's pipeline engine is built around the optimizer's groups once."""
    forward_needs_step = True
    """Stages only run inside ``@smp.step`` (the pipeline schedule drives them)."""
    clips_in_step = False

    def __init__(self, module: torch.nn.Module, *, plan: Plan, groups: ProcessGroups, microbatches: int,
                 tensor_parallel: TensorParallelView | None = None):
        """``plan`` and ``groups``: the run's Plan and process groups (the inputs the data-parallel backend gets
        too); ``tensor_parallel``: the whole model as ``parallelize`` sharded it, before the stages are cut (None
        without tensor parallelism)."""
        # The engine and optimizer live in the runner.
        from smp2ds.engine.pipeline import build_pipeline  # start-up: DeepSpeed's pipeline package

        self.module = module
        self.plan_ds = dict(plan.deepspeed)
        self.microbatches = microbatches
        self.has_optimizer = False
        self._clip_restore: Callable[[], None] | None = None
        self.tensor_parallel = tensor_parallel if tensor_parallel is not None and tensor_parallel.size > 1 else None
        self.runner = build_pipeline(module, plan, groups.topology)
        if self.tensor_parallel is not None:
            self._attach_tensor_parallel(self.tensor_parallel)
        self._groups = groups
        self._calls = 0

    def _attach_tensor_parallel(self, view: TensorParallelView) -> None:
        """Give the runner the view's state-dict maps, and its gradient correction once DeepSpeed's engine
        (whose optimizer decides between hooks and a correction before the reductions) exists."""
        runner = self.runner
        runner.full_tensor = view.full_tensor
        runner.local_part = view.local_part

        def correct_gradients(engine: Any) -> None:
            runner.before_reduce = view.gradient_correction(runner.module.parameters(), engine.optimizer)

        runner.on_engine_built = correct_gradients

    @property
    def engine(self) -> Any:
        return self.runner.engine

    @property
    def ds_optimizer(self) -> Any:
        return self.runner.optimizer

    @property
    def precision(self) -> str:
        return precision(self.plan_ds)

    @property
    def zero_stage(self) -> int:
        return zero_stage(self.plan_ds)

    @property
    def gradient_clipping(self) -> float:
        return float(self.plan_ds.get("gradient_clipping", 0.0))

    @property
    def overflow(self) -> bool:
        return dso.overflow(self.ds_optimizer)

    @property
    def loss_scale(self) -> float:
        return dso.loss_scale(self.ds_optimizer)

    def build(self, optimizer: Any = None, loss_scale: LossScaleArgs | None = None) -> None:
        if optimizer is None:
            return
        fp16 = self.runner.ds_config.get("fp16")
        if isinstance(fp16, dict) and fp16.get("enabled") and loss_scale is not None:
            self.runner.ds_config["fp16"] = {**fp16, **fp16_block(loss_scale)}
        self.runner.attach_optimizer(optimizer)
        self.has_optimizer = True

    def rebuild(self, optimizer: Any, loss_scale: LossScaleArgs | None, regroup: Callable[[], None]) -> None:
        raise SMPUnsupportedError("add_param_group with pipeline parallelism: the pipeline engine is built "
                                  "around the optimizer's groups; create the optimizer with every group")

    def ensure_built(self) -> None:
        pass

    def train(self, mode: bool) -> None:
        self.runner.train(mode)

    def run_step(self, model: Any, step_fn: Any, args: tuple, kwargs: dict) -> list[Any]:
        if self.runner.is_first_stage:
            pieces = step_fn.split(args, kwargs, self.microbatches)
        else:
            # SMP ignores the other stages' inputs (often empty dummies that cannot be split): the
            # runner replaces them with the first stage's micro-batches; these only supply objects.
            pieces = [(args, dict(kwargs))] * self.microbatches
        training = self.runner.training and torch.is_grad_enabled()
        reduce = True
        if training:
            self._calls += 1
            reduce = self._calls >= model.backward_passes_per_step
            if reduce:
                self._calls = 0
        with model.step_scope():  # the runner's schedule runs the micro-batches itself
            return self.runner.run_step(step_fn.func, pieces, reduce_grads=reduce)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.runner(*args, **kwargs)

    def step_backward(self, tensors: Any, grad_tensors: Any, microbatches: int, average: bool) -> None:
        self.runner.backward(tensors, grad_tensors)  # the runner's schedule applies 1/microbatches

    def sync_gradients(self) -> None:
        pass  # reduce_grads in run_step

    def optimizer_step(self) -> None:
        try:
            self.runner.optimizer_step()
        finally:
            if self._clip_restore is not None:
                self._clip_restore()
                self._clip_restore = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runner.zero_grad()

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        if self.zero_stage >= 1:
            return dso.zero_grad_norm(self.ds_optimizer, norm_type)
        # A tied weight (GPT-2's wte/lm_head) has a copy with the full gradient on two stages: count it once.
        params = [p for _, p in self.runner.local_named_parameters(include_replicas=False)]
        if self.tensor_parallel is not None:
            return self._stage_grad_norm(self.tensor_parallel, params, norm_type) / self.loss_scale
        grads = [p.grad.detach().float() for p in params if p.grad is not None]
        pipe_group = self._groups.group("pp")
        # born where the group communicates: a stage may hold no gradient
        start = torch.zeros((), device=comm.tensor_device(pipe_group))
        local = sum((torch.linalg.vector_norm(g, 2) ** 2 for g in grads), start)
        comm.all_reduce(local, group=pipe_group)
        return local.sqrt() / self.loss_scale

    def _stage_grad_norm(self, view: TensorParallelView, params: list[torch.nn.Parameter],
                         norm_type: float) -> torch.Tensor:
        """Norm over the whole model of this pipeline: each stage's norm (shards summed over the
        tensor-parallel group, replicated tensors once), then combined over the pipeline's stages.
        ``params``: this stage's parameters, tied copies on later stages excluded."""
        pipe_group = self._groups.group("pp")
        if norm_type == float("inf"):
            stage = view.grad_norm(params, norm_type).clone()
            comm.all_reduce(stage, op=comm.ReduceOp.MAX, group=pipe_group)
            return stage
        total = view.grad_norm(params, norm_type).pow(norm_type)
        comm.all_reduce(total, group=pipe_group)
        return total.pow(1.0 / norm_type)

    def clip_for_next_step(self, max_norm: float, norm: torch.Tensor) -> None:
        if self.precision == "fp32" and self.zero_stage == 0:
            dso.scale_grads((p for _, p in self.runner.local_named_parameters()), max_norm, norm)
            return
        self._clip_restore = dso.clip_in_step(self.ds_optimizer, max_norm)

    def full_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        return {prefix + k: v for k, v in self.runner.state_dict().items()}

    def local_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        return {prefix + k: v for k, v in self.runner.local_state_dict().items()}

    def load_module_state_dict(self, sd: dict, strict: bool = True) -> Any:
        return self.runner.load_state_dict(sd, strict=strict)

    def refresh_master_params(self) -> None:
        pass  # runner.load_state_dict refreshes DeepSpeed's master copy itself

    def local_named_parameters(self) -> Any:
        return self.runner.local_named_parameters()

    def local_modules(self) -> Any:
        return self.runner.local_modules()

    # ---- optimizer state (ZeRO-1 at most: DeepSpeed's pipeline engine accepts no more) -----------------------
    @property
    def optimizer_state_is_sharded(self) -> bool:
        return self.zero_stage >= 1

    def optimizer_state_dict(self) -> dict:
        return self.ds_optimizer.state_dict()

    def optimizer_partition(self) -> tuple[int, int]:
        """(index, count) of this rank's optimizer-state partition: DeepSpeed's data-parallel group is rdp."""
        return self._groups.coords.rdp_rank, self._groups.topology.rdp

    def load_optimizer_state_dict(self, sd: dict) -> None:
        dso.load_state(self.ds_optimizer, sd, self.zero_stage, self.optimizer_partition())

    @property
    def partitioned(self) -> bool:
        """The stages are cut when the backend is built, before the first step."""
        return True

    def param_shard_rank(self) -> int:
        return 0

    def param_shard_size(self) -> int:
        return 1
