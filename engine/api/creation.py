"""Model-creation context managers and registries: ``partition``, ``set_partition``,
``tensor_parallelism``, ``set_tensor_parallelism``, ``tp_register*``, ``model_creation``,
``delay_param_initialization``.

``partition`` / ``set_partition`` delegate to the pipeline engine's registry
(``smp2ds.engine.pipeline.manual``), which the pipeline backend reads when it splits the model.

Part of the public surface beside ``engine/__init__.py``, above the packages: it gathers what the
pipeline, tensor-parallel and MiCS packages do at model creation, which ``core`` may not import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from smp2ds.engine.core import creation_args
from smp2ds.engine.core.deepspeed_config import engine_config
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import (
    DistributedModelWrappedError,
    SMPUnsupportedError,
    StepFunctionCalledError,
)
from smp2ds.engine.nn.parallel import marks


def _manual() -> Any:
    """The pipeline package's partition registry."""
    from smp2ds.engine.pipeline import manual  # start-up: the pipeline package imports DeepSpeed's pipeline

    return manual


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created inside go to pipeline partition ``index`` (innermost context wins)."""
    with _manual().partition(index):
        yield


def set_partition(module: torch.nn.Module, partition: int, recurse: bool = True) -> None:
    """Assign an existing module (and its children) to a pipeline partition before the first step."""
    if state.step_calls:
        raise StepFunctionCalledError("smp.set_partition must be called before the first smp.step call")
    _manual().set_partition(module, partition, recurse=recurse)


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **kwargs: Any) -> Iterator[None]:
    """Mark modules created inside for tensor parallelism (:mod:`smp2ds.engine.nn.parallel.marks`)."""
    with marks.tensor_parallelism(enabled, **kwargs):
        yield


def set_tensor_parallelism(module: torch.nn.Module, enabled: bool = True, **kwargs: Any) -> None:
    """Mark (or unmark) an existing module tree for tensor parallelism, before ``DistributedModel``."""
    if state.model is not None:
        raise DistributedModelWrappedError("smp.set_tensor_parallelism must come before smp.DistributedModel")

    marks.set_tensor_parallelism(module, enabled, **kwargs)


def _register(module_cls: type, dist_module: type, init_hook: Callable | None, forward_hook: Callable | None,
              return_hook: Callable | None) -> None:
    # start-up: the tensor-parallel package reads every Hugging Face family's rules; a script that registers
    # nothing never loads it before smp.DistributedModel
    from smp2ds.engine.tensor_parallel import registry

    registry.register(module_cls, dist_module, init_hook, forward_hook, return_hook)


def tp_register(dist_module: type, init_hook: Callable | None = None, forward_hook: Callable | None = None,
                return_hook: Callable | None = None) -> Callable[[type], type]:
    """Class decorator registering ``dist_module`` as the tensor-parallel version of the class."""
    def decorate(cls: type) -> type:
        _register(cls, dist_module, init_hook, forward_hook, return_hook)
        return cls

    return decorate


def tp_register_with_module(module_cls: type, dist_module: type, init_hook: Callable | None = None,
                            forward_hook: Callable | None = None, return_hook: Callable | None = None,
                            translate_functions: tuple[Callable, Callable] | None = None) -> None:
    """Register ``dist_module`` as the tensor-parallel version of an existing class."""
    _register(module_cls, dist_module, init_hook, forward_hook, return_hook)
    if translate_functions is not None:
        state.module_manager.translate_functions.append(tuple(translate_functions))


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Create parameters already sharded over the MiCS shard group (sharded data parallelism), or on the meta
    device for a model SMP's distributed transformer replaces; otherwise parameters are created normally."""
    with _sharded_creation(enabled):
        yield


@contextlib.contextmanager
def _sharded_creation(enabled: bool) -> Iterator[None]:
    """Parameters created inside are born partitioned over the shard group (under sdp), or, for a model SMP's
    distributed transformer will replace, on the ``meta`` device (:func:`_meta_creation`)."""
    if enabled and state.initialized and state.mics_groups is None and _replaced_later():
        with _meta_creation():
            yield
        return
    if not (enabled and state.initialized and state.mics_groups is not None):
        yield
        return
    from smp2ds.engine import mics  # start-up: the MiCS package imports DeepSpeed's ZeRO-3

    ds = engine_config(state.plan.deepspeed, microbatches=state.plan.engine_settings.microbatches)
    with mics.mics_init_context(ds, state.mics_groups):
        yield


def _replaced_later() -> bool:
    """Modules created now are marked for tensor parallelism with SMP's distributed-transformer settings: a
    Hugging Face model built here is replaced by ``smp.nn.DistributedTransformerLMHead`` when wrapped."""
    mark = marks.active()
    return bool(mark is not None and mark.enabled and mark.kwargs)


@contextlib.contextmanager
def _meta_creation() -> Iterator[None]:
    """SMP's delayed parameter initialisation for a model its distributed transformer replaces: the Hugging Face
    model is built on the ``meta`` device (no memory), and the replacement materialises only this rank's shards
    (:mod:`smp2ds.engine.tensor_parallel.transformer_replacement`)."""
    try:
        with torch.device("meta"):
            yield
    except RuntimeError as err:
        if "from_pretrained" not in str(err):
            raise
        raise SMPUnsupportedError(
            "from_pretrained inside delay_param_initialization with SMP's distributed transformer settings: the "
            "model is built on the meta device and holds no weights, so there is nothing to load them into; build "
            "it with from_config and load the pretrained state dict after smp.DistributedModel (SMP's fine-tune "
            "path: smp.resume_from_checkpoint(dir, tag='fullmodel.pt', partial=False)), or turn "
            "delayed_parameter_initialization off") from None


@contextlib.contextmanager
def model_creation(tensor_parallelism: bool = False, dtype: torch.dtype | None = None,
                   zero_init: bool | None = None, **tensor_parallel_config: Any) -> Iterator[None]:
    """SMP 1.10+: build the model inside; modules are created as SMP would create them.

    * ``tensor_parallelism`` / ``**tensor_parallel_config``: ``smp.tensor_parallelism(enabled, **config)``
      around the creation (the keys configure the distributed modules; unknown keys are refused);
    * ``zero_init``: under sharded data parallelism, create parameters already partitioned over the
      shard group (``p.ds_tensor`` exists right away). ``None`` follows
      ``delayed_parameter_initialization``; ``False`` creates them whole (DeepSpeed partitions them
      when ``smp.DistributedOptimizer`` builds the engine). Without sdp there is nothing to
      partition over and it has no effect, as in SMP; ``delayed_parameter_initialization`` then builds a model
      SMP's distributed transformer replaces on the meta device (:func:`_meta_creation`);
    * ``dtype``: the default dtype while creating (restored afterwards). Partitioned creation makes
      parameters in the training precision (DeepSpeed's rule), so there a different dtype is refused.
    """
    creation_args.check(tensor_parallelism, dtype, zero_init, tensor_parallel_config)
    delayed = _delayed_at_creation(zero_init)
    if delayed and state.mics_groups is not None and dtype is not None:
        creation_args.check_partitioned_dtype(dtype, state.plan.deepspeed)
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        marking = tensor_parallelism_marking(bool(tensor_parallelism), tensor_parallel_config)
        with marking, _sharded_creation(delayed):
            yield
    finally:
        torch.set_default_dtype(previous)


def tensor_parallelism_marking(enabled: bool, config: dict[str, Any]) -> contextlib.AbstractContextManager:
    """The tensor-parallel part of ``model_creation``: SMP's ``tensor_parallelism(enabled, **config)``."""
    return tensor_parallelism(enabled, **config)


def _delayed_at_creation(zero_init: bool | None) -> bool:
    """Whether ``model_creation`` delays parameter initialisation: ``delayed_parameter_initialization``, or under
    sharded data parallelism ``zero_init`` when given."""
    if not state.initialized:
        return False
    if zero_init is None or state.mics_groups is None:
        return state.plan.engine_settings.delayed_parameter_initialization
    return bool(zero_init)


def is_tracing() -> bool:
    """SMP traces the model for auto-partitioning; smp2ds never runs such a pass."""
    return False
