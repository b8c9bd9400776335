"""The pipeline backend: ``DistributedModel`` on DeepSpeed's pipeline engine.

The pipeline runner owns the micro-batch loop (DeepSpeed's pipeline schedule), the model call
and the recorded loss; this backend maps the SMP objects' calls onto it. It shares
:class:`~smp2ds.engine.data_parallel.backend.DataParallelBackend`'s precision, clipping and
optimizer-state members (DeepSpeed's optimizer wrappers are the same).
"""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.core.deepspeed_config import LossScaleArgs, fp16_block, precision
from smp2ds.engine.data_parallel.backend import DataParallelBackend


class PipelineBackend(DataParallelBackend):
    """``pipeline_parallel_degree`` stages on DeepSpeed's ``PipelineEngine`` (via ``PipelineRunner``)."""

    name = "pipeline"
    cast_io = False

    def __init__(self, module: Any, *, state: Any, microbatches: int):
        # Not DataParallelBackend.__init__: the engine and optimizer live in the runner.
        from smp2ds.engine import pipeline
        from smp2ds.engine.tensor_parallel import stages as tp_stages

        self.module = module
        self.plan_ds = dict(state.plan.deepspeed)
        self.ds_config = None
        self.microbatches = microbatches
        self.has_optimizer = False
        self._clip_restore = None
        self.tp = tp_stages.shard_before_stages(module)  # tensor_parallel_degree > 1: shard, then cut
        self.runner = pipeline.build_pipeline(module, state.plan, state.groups.topology)
        tp_stages.attach(self.runner, self.tp, precision(self.plan_ds))
        self._state = state
        self._calls = 0

    @property
    def engine(self) -> Any:
        return self.runner.engine

    @property
    def ds_optimizer(self) -> Any:
        return self.runner.optimizer

    @property
    def precision(self) -> str:
        return precision(self.plan_ds)

    def build(self, optimizer: Any = None, loss_scale: LossScaleArgs | None = None) -> None:
        if optimizer is None:
            return
        fp16 = self.runner.ds_config.get("fp16")
        if isinstance(fp16, dict) and fp16.get("enabled") and loss_scale is not None:
            self.runner.ds_config["fp16"] = {**fp16, **fp16_block(loss_scale)}
        self.runner.attach_optimizer(optimizer)
        self.has_optimizer = True

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
        self._state.in_step = True
        try:
            return self.runner.run_step(step_fn.func, pieces, reduce_grads=reduce)
        finally:
            self._state.in_step = False

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
            return super().grad_norm(norm_type)
        # A tied weight (GPT-2's wte/lm_head) has a copy with the full gradient on two stages: count it once.
        params = [p for _, p in self.runner.local_named_parameters(include_replicas=False)]
        if self.tp.size > 1:
            from smp2ds.engine.tensor_parallel.stages import stage_grad_norm

            return stage_grad_norm(params, self.tp, self._state.groups.group("pp"), norm_type) / self.loss_scale
        grads = [p.grad.detach().float() for p in params if p.grad is not None]
        local = sum((torch.linalg.vector_norm(g, 2) ** 2 for g in grads), torch.tensor(0.0))
        comm.all_reduce(local, group=self._state.groups.group("pp"))
        return local.sqrt() / self.loss_scale

    def clip_for_next_step(self, max_norm: float, norm: torch.Tensor) -> None:
        if self.precision == "fp32" and self.zero_stage == 0:
            if torch.isfinite(norm) and float(norm) > max_norm:
                coef = max_norm / (float(norm) + 1e-6)
                for _, p in self.runner.local_named_parameters():
                    if p.grad is not None:
                        p.grad.detach().mul_(coef)
            return
        super().clip_for_next_step(max_norm, norm)

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
