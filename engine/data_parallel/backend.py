"""The DeepSpeed engine behind a ``DistributedModel`` for data parallelism, run in this process: DDP or ZeRO-1
(:mod:`smp2ds.engine.data_parallel.replicated`) or ZeRO-3 inside MiCS shard groups
(:mod:`smp2ds.engine.mics.sharding`), each with or without tensor parallelism.

:class:`DataParallelBackend` implements :class:`smp2ds.engine.core.backend.Backend`: the micro-batch loop, the
DeepSpeed engine calls, precision and clipping. Where the parameters live, and what follows from it (how the
engine is initialised, whether gradients are reduced inside backward, the state dicts, the optimizer
partition), it asks its :class:`~smp2ds.engine.core.parameter_sharding.ParameterSharding`, which the backend
factory builds. With tensor parallelism the placement holds the model ``parallelize`` sharded (a
:class:`~smp2ds.engine.core.tensor_parallel_view.TensorParallelView`): unequal batches are refused when the
group joins them, and the group's per-rank gradients are combined before the reduction.

Gradient timing matches SMP: every micro-batch's ``model.backward`` only accumulates locally;
after the micro-batch loop of every ``backward_passes_per_step``-th step call the gradients are
reduced once (DeepSpeed's ``allreduce_gradients`` with the accumulation boundary forced, the
pattern DeepSpeed's own pipeline engine uses). ``optimizer.step()`` then runs DeepSpeed's
``engine.step()`` at that boundary (overflow check, unscale/clip, update, zero). Under ZeRO-3 the gradients
are reduce-scattered inside each backward instead, and the step's last backward is the boundary.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from smp2ds.engine.core import deepspeed_config as dsc
from smp2ds.engine.core import deepspeed_optimizer as dso
from smp2ds.engine.core.model_io import scalar_for_backward
from smp2ds.engine.core.parameter_sharding import ParameterSharding
from smp2ds.engine.core.tensor_parallel_view import TensorParallelView
from smp2ds.engine.exceptions import SMPUnsupportedError


def _allow_cpu_fp16(ds: dict) -> None:
    """DeepSpeed's CPU accelerator refuses fp16 unless oneDNN has fp16 kernels; PyTorch's own
    CPU fp16 kernels work (slowly). ``SMP2DS_ALLOW_CPU_FP16=1`` lets DeepSpeed's fp16 path run on
    them — used by the tests to exercise real loss scaling without a GPU."""
    if dsc.precision(ds) != "fp16":
        return
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu" or acc.is_fp16_supported():
        return
    if os.environ.get("SMP2DS_ALLOW_CPU_FP16") != "1":
        raise SMPUnsupportedError(
            "fp16 is configured but DeepSpeed does not support fp16 on this CPU (no oneDNN fp16 kernels). "
            "Use bf16: true, run on a GPU, or set SMP2DS_ALLOW_CPU_FP16=1 to run DeepSpeed's fp16 path on "
            "PyTorch's (slow) CPU fp16 kernels"
        )
    acc.is_fp16_supported = lambda: True  # instance override on DeepSpeed's accelerator singleton
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]


class DataParallelBackend:
    """One DeepSpeed engine over the data-parallel group, parameters placed as ``sharding`` says."""

    cast_io = True
    """DistributedModel casts floating inputs to the 16-bit dtype and outputs back to fp32 (SMP's
    16-bit module wrapper); backends whose engine does it themselves set this False."""
    can_rebuild_optimizer = True
    """``rebuild`` works (before the first step): ``add_param_group`` under ZeRO or 16-bit masters."""
    forward_needs_step = False
    """The model may run outside ``@smp.step`` (evaluation code calling it directly)."""

    def __init__(self, module: torch.nn.Module, plan_ds: dict, *, microbatches: int, sharding: ParameterSharding):
        """``sharding``: where parameters live (replicated for DDP / ZeRO-1, or MiCS shard groups), and the
        tensor-parallel model they belong to."""
        self.module = module
        self.sharding: ParameterSharding = sharding
        self.tensor_parallel: TensorParallelView | None = self.sharding.tensor_parallel
        self.name: str = self.sharding.name
        self.collective_state_dict: bool = self.sharding.collective_state_dict
        self.clips_in_step: bool = self.sharding.clips_in_step
        """True when DeepSpeed clips inside the step and ``clip_master_grads`` does nothing (SMP's sdp)."""
        self._before_reduce: Callable[[list[torch.nn.Parameter]], None] | None = None
        self.plan_ds = dict(plan_ds)
        self.microbatches = microbatches
        self.engine: Any = None
        self.ds_optimizer: Any = None
        self.ds_config: dict | None = None
        self.has_optimizer = False
        self.synced = False
        self._pending_backward = False
        self._clip_restore: Any = None
        self._step_model: Any = None

    # ---- construction --------------------------------------------------------------------
    def build(self, optimizer: torch.optim.Optimizer | None = None,
              loss_scale: dsc.LossScaleArgs | None = None) -> None:
        """Create the DeepSpeed engine (again, if it existed without an optimizer)."""
        if self.engine is not None and (self.has_optimizer or optimizer is None):
            return
        if self.engine is not None:
            self.engine.destroy()
        ds = dsc.engine_config(self.plan_ds, microbatches=self.microbatches, loss_scale=loss_scale)
        _allow_cpu_fp16(ds)
        result = self.sharding.initialize(model=self.module, optimizer=optimizer, config=ds)
        self.engine, self.ds_optimizer = result[0], result[1]
        self.ds_config = ds
        self.has_optimizer = optimizer is not None
        if self.has_optimizer:
            self.engine.set_gradient_accumulation_boundary(False)
            if self.tensor_parallel is not None:
                self._before_reduce = self.tensor_parallel.gradient_correction(self.module.parameters(),
                                                                               self.ds_optimizer)

    def rebuild(self, optimizer: torch.optim.Optimizer, loss_scale: dsc.LossScaleArgs | None,
                regroup: Callable[[], None]) -> None:
        """Destroy the engine, let ``regroup()`` change the optimizer's parameter groups (before any
        step), and build the engine again around the optimizer."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        regroup()
        self.has_optimizer = False
        self.build(optimizer, loss_scale)

    def ensure_built(self) -> None:
        if self.engine is None:
            self.build(None)

    @property
    def precision(self) -> str:
        return dsc.precision(self.ds_config or self.plan_ds)

    @property
    def zero_stage(self) -> int:
        return dsc.zero_stage(self.ds_config or self.plan_ds)

    @property
    def gradient_clipping(self) -> float:
        """The clipping value of DeepSpeed's configuration (0.0: none)."""
        return float((self.ds_config or self.plan_ds).get("gradient_clipping", 0.0))

    # ---- one SMP step -----------------------------------------------------------------------
    def run_step(self, model: Any, step_fn: Any, args: tuple, kwargs: dict) -> list[Any]:
        """Run ``step_fn`` once per micro-batch in this process; returns the per-micro-batch results."""
        self.ensure_built()
        if self.tensor_parallel is not None:
            self.tensor_parallel.check_equal_batches(args, kwargs)
        pieces = step_fn.split(args, kwargs, self.microbatches)
        outputs = []
        self._step_model = model
        try:
            for index, (mb_args, mb_kwargs) in enumerate(pieces):
                with model.microbatch_scope(index, len(pieces)):
                    outputs.append(step_fn.func(*mb_args, **mb_kwargs))
        finally:
            self._step_model = None
        return outputs

    def train(self, mode: bool) -> None:
        if self.engine is not None:
            self.engine.train(mode)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.ensure_built()
        return self.engine(*args, **kwargs)

    @property
    def optimizer_state_is_sharded(self) -> bool:
        """True when every rank holds a different part of the optimizer state (one file per rank)."""
        return self.sharding.optimizer_state_is_sharded(self.zero_stage)

    def step_backward(self, tensors: Any, grad_tensors: Any, microbatches: int, average: bool) -> None:
        """``model.backward(tensors, grad_tensors)`` for one micro-batch (SMP semantics)."""
        loss = scalar_for_backward(tensors, grad_tensors)
        if average and microbatches > 1:
            loss = loss / microbatches  # SMP's average_grads_across_microbatches
        self.backward(loss)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of one (already micro-batch-scaled) scalar loss, no communication."""
        if not self.has_optimizer:
            raise RuntimeError("model.backward needs smp.DistributedOptimizer(...) to be created first "
                               "(DeepSpeed builds its engine around the optimizer)")
        # ZeRO-3: the step's last backward before optimizer.step() runs as DeepSpeed's accumulation boundary, so
        # MiCS's replica all-reduce overlaps it (smp2ds.engine.mics.overlap); other backwards keep the boundary
        # off (their partitions are not final).
        model = self._step_model
        boundary = self.sharding.reduces_in_backward and model is not None and model.ends_accumulation()
        if boundary:
            self.engine.set_gradient_accumulation_boundary(True)
        try:
            self.engine.backward(loss, scale_wrt_gas=False)
        finally:
            if boundary:
                self.engine.set_gradient_accumulation_boundary(False)
        self._pending_backward = True
        self.synced = False

    def sync_gradients(self) -> None:
        """Reduce the accumulated gradients across the data-parallel group (once per optimizer step)."""
        if not self._pending_backward or self.synced:
            return
        if self.sharding.reduces_in_backward:
            # ZeRO-3 already reduce-scattered each micro-batch inside backward; MiCS's replica all-reduce
            # runs inside optimizer.step (installed by mics.initialize).
            self.synced = True
            return
        if self._before_reduce is not None:
            self._before_reduce(list(self.module.parameters()))
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.allreduce_gradients()
        self.synced = True

    def optimizer_step(self) -> None:
        self.sync_gradients()
        self.engine.set_gradient_accumulation_boundary(True)
        try:
            self.engine.step()
        finally:
            self.engine.set_gradient_accumulation_boundary(False)
            self._pending_backward = False
            self.synced = False
            if self._clip_restore is not None:
                self._clip_restore()
                self._clip_restore = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        opt = self.ds_optimizer
        if opt is not None and hasattr(opt, "zero_grad") and (self.precision != "fp32" or self.zero_stage > 0):
            opt.zero_grad(set_to_none=set_to_none)
        else:
            for p in self.module.parameters():
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.detach_().zero_()

    # ---- precision and clipping ---------------------------------------------------------------
    @property
    def overflow(self) -> bool:
        return dso.overflow(self.ds_optimizer)

    @property
    def loss_scale(self) -> float:
        return dso.loss_scale(self.ds_optimizer)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Global norm of the synchronised, unscaled gradients (``inf``/``nan`` on overflow)."""
        if self.clips_in_step:
            raise SMPUnsupportedError("clip_master_grads with sharded data parallelism: DeepSpeed clips inside the "
                                      "step; set sdp_gradient_clipping in the configuration instead")
        self.sync_gradients()
        if self.zero_stage >= 1:
            # DeepSpeed's ZeRO optimizer computes the norm (with the mpu: shards once, replicas once)
            return dso.zero_grad_norm(self.ds_optimizer, norm_type)
        if self.tensor_parallel is not None:
            return self.tensor_parallel.grad_norm(self.module.parameters(), norm_type) / self.loss_scale
        grads = [p.grad.detach().float() for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        # Gradients are identical on every data-parallel rank after the reduction.
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]),
                                        norm_type)
        return norm / self.loss_scale

    def clip_for_next_step(self, max_norm: float, norm: torch.Tensor) -> None:
        """Clip at ``max_norm`` in the coming ``optimizer.step()``."""
        if self.precision == "fp32" and self.zero_stage == 0:
            dso.scale_grads(self.module.parameters(), max_norm, norm)
            return
        self._clip_restore = dso.clip_in_step(self.ds_optimizer, max_norm)

    def refresh_master_params(self) -> None:
        """After the module's weights were replaced, copy them into DeepSpeed's fp32 master copy."""
        opt = self.ds_optimizer
        if opt is not None and hasattr(opt, "refresh_fp32_params") and (self.precision != "fp32" or self.zero_stage):
            opt.refresh_fp32_params()

    # ---- optimizer state ------------------------------------------------------------------------
    def optimizer_state_dict(self) -> dict:
        return self.ds_optimizer.state_dict()

    def optimizer_partition(self) -> tuple[int, int]:
        """(index, count) of this rank's optimizer-state partition in DeepSpeed's data-parallel group."""
        return self.sharding.optimizer_partition()

    def load_optimizer_state_dict(self, sd: dict) -> None:
        """Load this rank's optimizer state (its ZeRO-1 partition when sharded)."""
        dso.load_state(self.ds_optimizer, sd, self.zero_stage, self.optimizer_partition())

    # ---- module state and parameters ------------------------------------------------------------
    @property
    def partitioned(self) -> bool:
        """Data-parallel models are never split, so they count as partitioned from the start."""
        return True

    def full_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """Every tensor whole under its original name (a collective when ``collective_state_dict``)."""
        return self.sharding.full_state_dict(self, prefix, keep_vars)

    def local_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict:
        """What this rank's partial checkpoint holds, under the original names."""
        return self.sharding.local_state_dict(self, prefix, keep_vars)

    def load_module_state_dict(self, sd: dict, strict: bool = True) -> Any:
        """Load full tensors (cut to this rank's part) or this rank's shards."""
        return self.sharding.load_module_state_dict(self, sd, strict)

    def local_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters()

    def local_modules(self) -> Iterable[torch.nn.Module]:
        return self.module.modules()

    def param_shard_rank(self) -> int:
        """SMP's ``param_shard_rank``: this rank's place among the ranks sharing its parameters (0: none)."""
        return self.sharding.param_shard_rank()

    def param_shard_size(self) -> int:
        """SMP's ``param_shard_size``: ranks sharing one copy of the parameters (1: not sharded)."""
        return self.sharding.param_shard_size()
