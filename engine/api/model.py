"""``smp.DistributedModel``: SMP's model wrapper, running on a DeepSpeed engine.

The wrapped module keeps its own parameter names (``state_dict`` keys, ``named_parameters``),
as SMP's did, so checkpoints load into the plain model. The DeepSpeed engine is built when
``smp.DistributedOptimizer`` is created (DeepSpeed builds around the optimizer), or at the first
step for a model that is only evaluated.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from smp2ds.engine.api import pretrained_save, wrapper_views
from smp2ds.engine.api.backend_factory import make_backend, parameter_roles, prepare_module
from smp2ds.engine.core import checkpoint_format, device_placement, model_io
from smp2ds.engine.core.backend import Backend
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import (
    BwdExecutionNotInStepFnError,
    FwdExecutionNotInStepFnError,
    MultipleDistributedModelError,
    SMPInvalidArgumentError,
    SMPUnsupportedError,
)
from smp2ds.engine.nn.parallel import context as parallel_context

_NO_EFFECT = {
    "trace_execution_times": (False, "tracing only serves automatic pipeline partitioning"),
    "trace_memory_usage": (False, "tracing only serves automatic pipeline partitioning"),
    "overlapping_allreduce": (
        True,
        (
            "gradients are reduced once per optimizer step by DeepSpeed after the "
            "micro-batch loop; results are identical either way"
        ),
    ),
    "bucket_cap_mb": (
        25,
        ("DeepSpeed sizes its own reduction buckets (allreduce_bucket_size / zero_optimization.reduce_bucket_size)"),
    ),
    "find_unused_parameters": (False, "DeepSpeed skips parameters without gradients by itself"),
    "broadcast_buffers": (
        True,
        (
            "buffers are broadcast from rank 0 once when the DeepSpeed engine is built, "
            "not before every forward as torch DDP does"
        ),
    ),
    "gradient_as_bucket_view": (False, "DeepSpeed manages gradient buffers itself"),
}


def _refuse_modules_of_another_group(module: torch.nn.Module, context: parallel_context.ParallelContext) -> None:
    foreign = parallel_context.built_for_another_group(module, context)
    if foreign:
        shown = ", ".join(repr(name) for name in foreign[:3]) + (f" and {len(foreign) - 3} more"
                                                                  if len(foreign) > 3 else "")
        raise SMPUnsupportedError(
            f"smp.DistributedModel: the model's smp.nn modules {shown} were built for another tensor-parallel group "
            f"than this run's (tensor_parallel_degree {context.tp.size}), for example before smp.init(); build "
            "smp.nn modules after smp.init()")


_log = logging.getLogger("smp2ds")


def distributed_transformer_note(count: int, tp: int) -> str:
    """The rank-0 line logged when ``smp.DistributedModel`` swaps models for SMP's distributed transformer."""
    return (f"smp.DistributedModel: {count} Hugging Face model part(s) replaced by SMP's distributed transformer "
            f"(tensor_parallel_degree {tp}); state dicts and partial checkpoints use SMP's names "
            "(transformer.seq_layers.*), save_pretrained and `smp2ds checkpoint export --to hf` translate them back")


class DistributedModel(torch.nn.Module):
    """Wrap ``module`` for SMP training; one per process (``smp.reset()`` allows another)."""

    backend: Backend  # set with object.__setattr__: a backend is not a submodule

    def __init__(
        self,
        module: torch.nn.Module,
        trace_device: str = "gpu",
        backward_passes_per_step: int = 1,
        average_grads_across_microbatches: bool = True,
        **kwargs: Any,
    ):
        state.require()
        if state.model is not None:
            raise MultipleDistributedModelError(
                "only one smp.DistributedModel may exist per process; call smp.reset() before creating another"
            )
        if trace_device not in ("gpu", "cpu"):
            raise SMPInvalidArgumentError(f"trace_device must be 'gpu' or 'cpu', got {trace_device!r}")
        if (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1
        ):
            raise SMPInvalidArgumentError(
                f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
            )
        if isinstance(module, DistributedModel):
            raise SMPInvalidArgumentError("the module is already a smp.DistributedModel")
        unknown = sorted(set(kwargs) - set(_NO_EFFECT))
        if unknown:
            raise SMPInvalidArgumentError(
                f"DistributedModel got unknown argument(s) {unknown}; accepted: "
                f"trace_device, backward_passes_per_step, average_grads_across_microbatches, "
                f"{', '.join(sorted(_NO_EFFECT))}"
            )
        if "overlapping_allreduce" in kwargs and not isinstance(kwargs["overlapping_allreduce"], bool):
            raise SMPInvalidArgumentError("overlapping_allreduce must be a bool")
        super().__init__()
        context = parallel_context.installed()  # smp.init's: the group smp.nn modules must have been built for
        _refuse_modules_of_another_group(module, context)
        # SMP's distributed transformer replaces marked models (any tp degree)
        replaced_before = len(state.module_manager.translate_functions)
        module = prepare_module(module, context)
        replaced = len(state.module_manager.translate_functions) - replaced_before
        if replaced and state.groups.rank == 0:
            _log.info("%s", distributed_transformer_note(replaced, context.tp.size))
        self.add_module("module", module)  # the `module` property returns SMP's wrapper chain
        runtime = state.runtime
        assert runtime is not None  # state.require() above
        settings = runtime.plan.engine_settings
        object.__setattr__(self, "_wrapper_view", wrapper_views.wrapper_chain(
            module, data_parallel=settings.data_parallel.ddp_api and not settings.mics.enabled,
            sixteen_bit=settings.precision.dtype != "fp32"))
        self.trace_device = trace_device
        self.backward_passes_per_step = backward_passes_per_step
        self.average_grads_across_microbatches = bool(average_grads_across_microbatches)
        self.ignored_arguments = _explain(kwargs)
        object.__setattr__(self, "backend", make_backend(module, runtime))
        # SMP moved the tensors a step receives to the model's device (cuda:local_rank()); None on
        # the CPU, where inputs are left exactly as given (see device_placement).
        object.__setattr__(self, "_input_device", device_placement.step_input_device(
            state.launch.local_rank, state.groups.coords.pp_rank))
        # OrderedDict, not dict: torch's RemovableHandle keeps a weak reference to it
        self._post_step_hooks: dict[int, Callable] = OrderedDict()
        self._post_partition_hooks: dict[int, Callable] = OrderedDict()
        # Step counters live in a plain object: nn.Module.__setattr__ is slow on the step path.
        object.__setattr__(self, "_count", _StepCounters())
        state.model = self
        # A checkpoint requested before the model existed loads once the engine is built
        # (DistributedOptimizer creation, or the first step), so sharded engines can take it.
        self._pending_load, state.pending_model_load = state.pending_model_load, None

    # ---- SMP properties --------------------------------------------------------------------
    @property
    def partitioned(self) -> bool:
        """Data-parallel models are never split, so they count as partitioned from the start."""
        return bool(self.backend.partitioned)

    def get_module(self) -> torch.nn.Module:
        """The user's module (SMP unwraps its DDP/16-bit wrappers here)."""
        return self._modules["module"]

    @property
    def module(self) -> torch.nn.Module:  # type: ignore[override]
        """What SMP's ``model.module`` was: its data-parallel wrapper under ``ddp`` (the user's module at
        ``model.module.module``), with a 16-bit wrapper inside it under ``fp16``/``bf16``; the user's module
        itself otherwise (see ``wrapper_views``). ``get_module()`` always returns the user's module."""
        return self._wrapper_view

    # ---- forward / backward ------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.backend.forward_needs_step and not state.in_step:
            raise FwdExecutionNotInStepFnError(
                "with pipeline parallelism the model may only run inside an @smp.step function"
            )
        precision = self.backend.precision
        if precision != "fp32" and self.backend.cast_io:
            dtype = torch.float16 if precision == "fp16" else torch.bfloat16
            args, kwargs = model_io.cast_floating((args, kwargs), dtype)
            return model_io.cast_floating(self.backend.forward(*args, **kwargs), torch.float32, only=dtype)
        return self.backend.forward(*args, **kwargs)

    def backward(self, tensors: Any, grad_tensors: Any = None) -> None:
        """Replace ``loss.backward()`` inside an ``@smp.step`` function."""
        if not state.in_step:
            raise BwdExecutionNotInStepFnError("model.backward(...) must be called inside an @smp.step function")
        self.backend.step_backward(tensors, grad_tensors, self._count.mb_count, self.average_grads_across_microbatches)
        self._count.backwards_in_call += 1

    # ---- the step -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def microbatch_scope(self, index: int, count: int) -> Iterator[None]:
        """Mark micro-batch ``index`` of ``count`` as running (backends call this)."""
        state.in_step, state.microbatch, self._count.mb_count = True, index, count
        try:
            yield
        finally:
            state.in_step, state.microbatch = False, 0

    @contextlib.contextmanager
    def step_scope(self) -> Iterator[None]:
        """Mark a step as running, for a backend whose schedule runs the micro-batches itself (the pipeline)."""
        state.in_step = True
        try:
            yield
        finally:
            state.in_step = False

    def defer_load(self, load: Callable[[DistributedModel], None]) -> None:
        """Run ``load(self)`` once the engine is built (now, if it already is with its optimizer)."""
        if state.optimizer is not None:
            load(self)
        else:
            self._pending_load = load

    def apply_pending_load(self) -> None:
        pending, self._pending_load = self._pending_load, None
        if pending is not None:
            pending(self)

    def run_step(self, step_fn: Any, args: tuple, kwargs: dict) -> list[Any]:
        """Run one ``@smp.step`` call through the backend; returns per-micro-batch results."""
        self.apply_pending_load()
        if self._count.steps_done == 0:
            self._run_hooks(self._post_partition_hooks)
        self._count.backwards_in_call = 0
        if self._input_device is not None:
            args, kwargs = step_fn.to_device(args, kwargs, self._input_device)
        outputs = self.backend.run_step(self, step_fn, args, kwargs)
        if self._count.backwards_in_call:
            self._count.calls_since_sync += 1
            if self._count.calls_since_sync >= self.backward_passes_per_step:
                self.backend.sync_gradients()
                self._count.calls_since_sync = 0
        self._count.steps_done += 1
        state.step_calls += 1
        if self._count.steps_done == 1:
            self._run_hooks(self._post_step_hooks)  # SMP fires post-step hooks once, after the first step
        return outputs

    def ends_accumulation(self) -> bool:
        """True while the last micro-batch of an ``@smp.step`` call runs whose gradients the next
        ``optimizer.step()`` uses (``backward_passes_per_step`` reached): DeepSpeed's accumulation
        boundary, which lets a backend start communication during that backward."""
        return (state.in_step and state.microbatch == self._count.mb_count - 1
                and self._count.calls_since_sync + 1 >= self.backward_passes_per_step)

    def _optimizer_stepped(self) -> None:
        self._count.calls_since_sync = 0

    def _run_hooks(self, hooks: dict[int, Callable]) -> None:
        for key in list(hooks):
            hooks.pop(key)(self, state.optimizer)

    def _register(self, hooks: dict[int, Callable], hook: Callable, run_now: bool) -> RemovableHandle | None:
        if run_now and state.optimizer is not None:
            hook(self, state.optimizer)
            return None
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def register_post_partition_hook(self, hook: Callable) -> RemovableHandle | None:
        """``hook(model, optimizer)`` once before the first step (at once if that moment has passed)."""
        return self._register(self._post_partition_hooks, hook, run_now=self._count.steps_done > 0)

    def register_post_step_hook(self, hook: Callable) -> RemovableHandle | None:
        """``hook(model, optimizer)`` once after the first step (at once if it has run)."""
        return self._register(self._post_step_hooks, hook, run_now=self._count.steps_done > 0)

    # ---- state dicts ---------------------------------------------------------------------------
    def state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        cast_to_cpu: bool = True,
        gather_to_rank0: bool = False,
    ) -> dict[str, Any]:
        """The full model state dict with the wrapped module's key names (all ranks, or rank 0 only)."""
        sd = self.backend.full_state_dict(prefix=prefix, keep_vars=keep_vars)
        if gather_to_rank0 and state.groups.rank != 0:
            return {}
        sd = model_io.to_cpu(sd) if cast_to_cpu else sd
        if destination is not None:
            destination.update(sd)
            return destination
        return sd

    def local_state_dict(
        self,
        cast_to_cpu: bool = True,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        scaled_batch_only: bool = False,
    ) -> dict[str, Any]:
        """What this rank holds, marked ``_smp_is_partial`` (SMP's per-rank checkpoint format);
        ``scaled_batch_only``: only the scaled-batch parameters and buffers (see ``is_scaled_batch_*``)."""
        sd = self.backend.local_state_dict(prefix=prefix, keep_vars=keep_vars)
        if scaled_batch_only:
            tp = state.groups.topology.tp
            scaled = {prefix + n for n, _ in self.scaled_batch_reducer_named_parameters()} | {
                prefix + n for n, b in self.get_module().named_buffers()
                if id(b) in parameter_roles.scaled_batch_buffers(self.get_module(), tp)}
            sd = {k: v for k, v in sd.items() if k in scaled}
        sd = model_io.to_cpu(sd) if cast_to_cpu else dict(sd)
        sd[checkpoint_format.PARTIAL_MARK] = True
        sd[checkpoint_format.LOAD_INFO] = {
            "tensor_parallel_degree": state.groups.topology.tp,
            "pipeline_parallel_degree": state.groups.topology.pp,
            "partition_info": None,
        }
        if destination is not None:
            destination.update(sd)
            return destination
        return sd

    def load_state_dict(
        self,
        state_dict: Any,
        strict: bool = True,
        translate_function: Callable | None = None,
        same_partition_load: bool = True,
        assign: bool = False,
    ) -> Any:
        """Load a full, partial or plain PyTorch state dict (markers are stripped). A plain dict in Hugging Face's
        names (not marked ``_smp_is_partial``) goes through the replacements' ``hf_to_smp`` functions first."""
        sd = model_io.strip_markers(state_dict)
        if translate_function is not None:
            sd = translate_function(sd)
        elif checkpoint_format.PARTIAL_MARK not in state_dict:
            for _, hf_to_smp in state.module_manager.translate_functions:
                sd = hf_to_smp(sd)
        result = self.backend.load_module_state_dict(sd, strict=strict)
        if self.backend.engine is not None:
            self.backend.refresh_master_params()
        return result

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """The gathered model in Hugging Face's format and names, written by rank 0 (collective; see
        :mod:`smp2ds.engine.api.pretrained_save`)."""
        pretrained_save.save_pretrained(self, save_directory, **kwargs)

    # ---- parameters and modules (delegate to the wrapped module, as SMP did) ----------------------
    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.get_module().parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return self.get_module().named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.get_module().buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        return self.get_module().named_buffers(prefix, recurse, remove_duplicate)

    def local_parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return (p for _, p in self.local_named_parameters(recurse))

    def local_named_parameters(self, recurse: bool = True) -> Iterator:
        """Parameters this rank holds (its pipeline stage's, or all of them)."""
        return self.backend.local_named_parameters()

    def local_buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return self.get_module().buffers(recurse)

    def local_named_buffers(self, prefix: str = "", recurse: bool = True) -> Iterator:
        return self.get_module().named_buffers(prefix, recurse)

    def local_modules(self) -> Iterator[torch.nn.Module]:
        return iter(self.backend.local_modules())

    def local_named_modules(self, memo: Any = None, prefix: str = "") -> Iterator:
        return self.get_module().named_modules(memo, prefix)

    def is_local_parameter(self, param: Any) -> bool:
        return True

    def is_local_buffer(self, buf: Any) -> bool:
        return True

    # ---- tensor-parallel helpers (SMP v1.6+; answers from the sharding, see tensor_parallel.introspect) --
    def distributed_modules(self) -> Iterator[torch.nn.Module]:
        """The distributed modules: ``smp.nn`` modules and those the engine sharded in place."""
        return parameter_roles.distributed_modules(self.get_module())

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """True when ``param`` is split over the tensor-parallel ranks (this rank holds a shard)."""
        return parameter_roles.is_distributed(param)

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        """True when ``buf`` is split over the tensor-parallel ranks (the engine splits no buffers)."""
        return parameter_roles.is_distributed(buf)

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        """True when ``param`` sees the tensor-parallel group's batch (its gradient reduces over rdp)."""
        return parameter_roles.is_scaled_batch(param)

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        """True when ``buf`` belongs to a distributed module and tensor parallelism is on."""
        tp = state.groups.topology.tp
        return id(buf) in parameter_roles.scaled_batch_buffers(self.get_module(), tp)

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Named parameters whose gradients SMP all-reduces over the whole data-parallel group."""
        return iter(parameter_roles.split_by_reducer(self.get_module())[0])

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Named parameters whose gradients SMP all-reduces over the reduced-data-parallel group."""
        return iter(parameter_roles.split_by_reducer(self.get_module())[1])

    def get_param_name(self, param: torch.nn.Parameter) -> str:
        for name, p in self.get_module().named_parameters():
            if p is param:
                return name
        raise KeyError("parameter does not belong to this model")

    def size(self) -> int:
        """Bytes of parameters and buffers."""
        module = self.get_module()
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    def train(self, mode: bool = True) -> DistributedModel:
        super().train(mode)
        self.backend.train(mode)
        return self

    def cuda(self, *args: Any, **kwargs: Any) -> DistributedModel:
        warnings.warn("DistributedModel.cuda() is ignored: the engine places the model on its device", stacklevel=2)
        return self

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True) -> Any:
        raise SMPUnsupportedError(
            "DistributedModel.join (uneven inputs) is not supported on DeepSpeed; give every "
            "rank the same number of batches (DistributedSampler, drop_last=True)"
        )

    def register_comm_hook(self, state_: Any, hook: Callable) -> None:
        raise SMPUnsupportedError(
            "register_comm_hook needs torch DDP's reducer; DeepSpeed performs the gradient "
            "reduction, so communication hooks cannot be attached"
        )


class _StepCounters:
    """Where the model is in SMP's step cycle."""

    __slots__ = ("steps_done", "calls_since_sync", "backwards_in_call", "mb_count")

    def __init__(self) -> None:
        self.steps_done = 0
        """Completed ``@smp.step`` calls (hooks fire after the first)."""
        self.calls_since_sync = 0
        """Step calls with a backward since the last gradient reduction (``backward_passes_per_step``)."""
        self.backwards_in_call = 0
        self.mb_count = 1
        """Micro-batches of the running step (the divisor of ``average_grads_across_microbatches``)."""


def _explain(given: dict[str, Any]) -> dict[str, str]:
    """Warn once for every argument given with a value that behaves differently here."""
    notes = {}
    for name, value in given.items():
        default, why = _NO_EFFECT[name]
        if value != default or name == "broadcast_buffers":
            notes[name] = why
            warnings.warn(f"DistributedModel({name}={value!r}) has no effect on smp2ds: {why}", stacklevel=3)
    return notes
