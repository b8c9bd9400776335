"""Repairs to transformers' SageMaker-model-parallel code path, installed into transformers itself.

With ``SM_HP_MP_PARAMETERS`` (containing ``partitions``) and ``SM_FRAMEWORK_PARAMS``
(``sagemaker_mpi_enabled``) set, transformers imports ``smdistributed.modelparallel.torch``
(smp2ds), calls ``smp.init()`` and takes its SMP path. On the supported releases (4.41 to 5.x
alike) that path fails or trains wrongly in several places; importing smp2ds's ``smdistributed``
package installs the repairs below into ``TrainingArguments`` and ``Trainer`` (see
`class_repair_hook` for when), so a plain ``Trainer`` script runs unchanged. Every repaired method
defers to transformers' own when SMP is not enabled. An older transformers is refused by name
(`transformers_compat.require_supported_transformers`) on ``import smdistributed.modelparallel.torch`` and
again when these classes are defined. The differences between supported releases (the cached property
behind ``_setup_devices``) are `transformers_compat`'s.

``TrainingArguments``:

* Device. The SMP branch of ``_setup_devices`` picks ``cuda:<smp.local_rank()>``; with
  ``use_cpu=True`` it leaves the device unset (``UnboundLocalError``). With ``use_cpu`` or without
  CUDA the device is the CPU, and accelerate's process state adopts the process group
  ``smp.init`` created, counting every rank (it shards the data loaders by it).

``Trainer``:

1. Optimizer creation. transformers 5 delays optimizer creation under SMP but then never creates
   it (``create_scheduler`` fails on ``None``, as on real SMP), and never wraps an optimizer given
   as ``optimizers=(opt, ...)`` in ``smp.DistributedOptimizer``. Both happen right before the
   scheduler is built, after the model was wrapped: the order transformers 4.x used. Releases
   that do create it (5.0) then hand it to ``accelerator.prepare``, whose ``AcceleratedOptimizer``
   hides the SMP methods the Trainer calls (``local_state_dict``, ``clip_master_grads``): under
   SMP the accelerator leaves a ``DistributedOptimizer`` as it is.
2. Gradient clipping and the logged norm. Only fp16 runs clip through
   ``optimizer.clip_master_grads``; fp32 runs clip ``model.parameters()``' ``.grad``, which
   DeepSpeed's ZeRO-1 (``shard_optimizer_state``) has emptied, so nothing is clipped and the norm
   logs as 0. The Trainer's accelerator clips through ``clip_master_grads`` under SMP, which
   handles every precision and ZeRO stage.
3. Evaluation wraps the model once. ``evaluation_loop`` calls ``_wrap_model(self.model)`` and
   transformers 5 checks only its argument for a ``DistributedModel``, so it would wrap a second
   time (SMP forbids it): the process's one ``DistributedModel`` is reused.
4. Which rank reads which batch. accelerate shards data over all processes; SMP shards over the
   data-parallel ranks (``args.world_size`` is ``smp.dp_size()``): the stages of one pipeline read
   the same batch. Every data loader's shard is re-pointed at the data-parallel rank.
5. Evaluation gathers through ``smp.allgather`` over the data-parallel group (transformers'
   ``smp_gather``, as its SMP releases did; over the rdp group when the tensor-parallel ranks share their batch,
   ``prescaled_batch``), so predictions and labels hold each sample exactly
   once (accelerate would gather one copy per pipeline stage); the padding accelerate adds to the
   last batch is dropped as its ``gather_for_metrics`` does.
6. Resuming on older releases (4.41, 4.44): their ``_load_rng_state`` loads numpy's RNG state with a plain
   ``torch.load``, which torch >= 2.6 refuses (``weights_only``); under SMP it runs with the numpy allowlist
   later releases apply themselves (`transformers_compat.rng_checkpoint_globals`).
"""

from __future__ import annotations

import functools
from functools import cached_property
from typing import Any

import torch

from smp2ds.engine.api.optimizer import DistributedOptimizer
from smp2ds.engine.core.object_collectives import allgather
from smp2ds.engine.core.ranks import CommGroup
from smp2ds.engine.core.state import state
from smp2ds.engine.integrations.class_repair_hook import ClassRepair, install
from smp2ds.engine.integrations.transformers_compat import (
    cached_property_getter,
    require_supported_transformers,
    rng_checkpoint_globals,
)

__all__ = ["install_transformers_repairs"]

_MARK = "_smp2ds_smp_repairs"


def _smp_enabled() -> bool:
    from transformers.utils import is_sagemaker_mp_enabled

    return bool(is_sagemaker_mp_enabled())


def _mark_once(cls: type) -> bool:
    """True the first time for ``cls`` (repairs are applied once per class)."""
    if cls.__dict__.get(_MARK):
        return False
    setattr(cls, _MARK, True)
    return True


def _replace(cls: type, name: str, make: Any) -> None:
    """Replace method ``name`` of ``cls`` by ``make(original)``, keeping its name and docs."""
    original = getattr(cls, name)
    setattr(cls, name, functools.wraps(original)(make(original)))


# ---- TrainingArguments -----------------------------------------------------------------------
def repair_training_arguments(cls: type) -> None:
    require_supported_transformers()
    if not _mark_once(cls):
        return
    stock = cached_property_getter(cls.__dict__["_setup_devices"])

    def _setup_devices(self: Any) -> torch.device:
        if not _smp_enabled() or (torch.cuda.is_available() and not self.use_cpu):
            return stock(self)
        from accelerate.state import AcceleratorState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        # Told to use the CPU, accelerate counts every rank of the process group smp.init made
        # (it does not initialise another one) and shards the data loaders by it.
        PartialState(cpu=True)
        # As transformers' SMP branch: no `distributed_state`, so world size and ranks come from
        # smp.dp_size()/smp.dp_rank(); one device per process.
        self.distributed_state = None
        self._n_gpu = 1
        return torch.device("cpu")

    _setup_devices.__doc__ = stock.__doc__
    prop = cached_property(_setup_devices)
    prop.__set_name__(cls, "_setup_devices")
    cls._setup_devices = prop


# ---- Trainer ---------------------------------------------------------------------------------
def _clip_through_optimizer(trainer: Any, accelerator: Any, parameters: Any, max_norm: float,
                            norm_type: float = 2) -> Any:
    """``accelerator.clip_grad_norm_`` under SMP: the optimizer's ``clip_master_grads``."""
    clip = getattr(trainer.optimizer, "clip_master_grads", None)
    if clip is None:
        return type(accelerator).clip_grad_norm_(accelerator, parameters, max_norm, norm_type)
    if float(norm_type) != 2.0:
        raise ValueError(f"gradient clipping under SageMaker model parallelism clips the L2 norm; "
                         f"norm_type={norm_type!r} is not supported (allowed: 2)")
    return clip(max_norm)


def _prepare_optimizer(accelerator: Any, optimizer: Any, device_placement: Any = None) -> Any:
    """``accelerator.prepare_optimizer`` under SMP: an ``smp.DistributedOptimizer`` stays as it is."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer
    return type(accelerator).prepare_optimizer(accelerator, optimizer, device_placement=device_placement)


def _is_tensor_tree(data: Any) -> bool:
    if isinstance(data, (list, tuple)):
        return all(_is_tensor_tree(d) for d in data)
    if isinstance(data, dict):
        return all(_is_tensor_tree(d) for d in data.values())
    return isinstance(data, torch.Tensor)


def _truncate(data: Any, n: int) -> Any:
    if isinstance(data, (list, tuple)) and not _is_tensor_tree(data):
        return data[:n]
    if isinstance(data, (list, tuple)):
        return type(data)(_truncate(d, n) for d in data)
    if isinstance(data, dict):
        return type(data)({k: _truncate(v, n) for k, v in data.items()})
    return data[:n]


def _sample_group() -> CommGroup:
    """The group whose ranks hold different samples: the data-parallel group, or with ``prescaled_batch`` and
    tensor parallelism (the tensor-parallel ranks share their batch, as transformers shards it by rdp rank) the
    reduced-data-parallel group, so each sample is gathered once."""
    if state.cfg.prescaled_batch and state.groups.topology.tp > 1:
        return CommGroup.RDP_GROUP
    return CommGroup.DP_GROUP


def _gather_tensors(data: Any, group: CommGroup) -> Any:
    """transformers' ``smp_gather`` over ``group``: each tensor of the tree concatenated over the group's ranks."""
    if isinstance(data, (list, tuple)):
        return type(data)(_gather_tensors(d, group) for d in data)
    if isinstance(data, dict):
        return type(data)({k: _gather_tensors(v, group) for k, v in data.items()})
    return torch.cat([torch.atleast_1d(t).cpu() for t in allgather(data, group)], dim=0)


def _gather_over_data_parallel(accelerator: Any, data: Any, use_gather_object: bool = False) -> Any:
    """``accelerator.gather_for_metrics`` under SMP: ``smp.allgather`` over the ranks that hold different
    samples (:func:`_sample_group`)."""
    group = _sample_group()
    if use_gather_object or not _is_tensor_tree(data):
        gathered = [item for part in allgather(data, group) for item in part]
    else:
        gathered = _gather_tensors(data, group)
    gradients = accelerator.gradient_state
    # The last batch is padded (with repeated samples) so every rank has one; drop the padding.
    if gradients.end_of_dataloader and gradients.remainder > 0:
        return _truncate(gathered, gradients.remainder)
    return gathered


def _shard_by_data_parallel_rank(trainer: Any, loader: Any) -> Any:
    shard = getattr(loader, "batch_sampler", None)
    if hasattr(shard, "num_processes") and hasattr(shard, "process_index"):
        shard.num_processes, shard.process_index = trainer.args.world_size, trainer.args.process_index
    return loader


def repair_trainer(cls: type) -> None:
    require_supported_transformers()
    if not _mark_once(cls):
        return

    def after_accelerator(original: Any) -> Any:
        def create_accelerator_and_postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            if _smp_enabled():
                acc = self.accelerator
                acc.clip_grad_norm_ = functools.partial(_clip_through_optimizer, self, acc)
                acc.prepare_optimizer = functools.partial(_prepare_optimizer, acc)
                acc.gather_for_metrics = functools.partial(_gather_over_data_parallel, acc)
                # the Trainer keeps its own reference (and resets it to the accelerator's after
                # each evaluation, which now finds this one)
                keywords = getattr(self, "gather_function", None)
                keywords = keywords.keywords if isinstance(keywords, functools.partial) else {}
                self.gather_function = functools.partial(acc.gather_for_metrics, **keywords)
            return result
        return create_accelerator_and_postprocess

    def wrap_once(original: Any) -> Any:
        def _wrap_model(self: Any, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if _smp_enabled():
                existing = state.model  # smp.state.model: the process's one DistributedModel
                if existing is not None and (model is existing or model is existing.get_module()):
                    return existing
            return original(self, model, *args, **kwargs)
        return _wrap_model

    def optimizer_before_scheduler(original: Any) -> Any:
        def create_scheduler(self: Any, num_training_steps: int, optimizer: Any = None) -> Any:
            if optimizer is None and _smp_enabled() and not isinstance(self.optimizer, DistributedOptimizer):
                if self.optimizer is None:
                    self.create_optimizer()
                else:
                    # Trainer(optimizers=(opt, ...)): accelerate may have wrapped it
                    # (AcceleratedOptimizer adds nothing under SMP); SMP needs the user's optimizer.
                    user = self.optimizer
                    if type(user).__name__ == "AcceleratedOptimizer":
                        user = user.optimizer
                    self.optimizer = DistributedOptimizer(user)
            return original(self, num_training_steps, optimizer)
        return create_scheduler

    def data_parallel_shards(original: Any) -> Any:
        def get_dataloader(self: Any, *args: Any, **kwargs: Any) -> Any:
            loader = original(self, *args, **kwargs)
            return _shard_by_data_parallel_rank(self, loader) if _smp_enabled() else loader
        return get_dataloader

    def rng_state_allowlisted(original: Any) -> Any:
        def _load_rng_state(self: Any, checkpoint: Any) -> Any:
            if not _smp_enabled():
                return original(self, checkpoint)
            with rng_checkpoint_globals():
                return original(self, checkpoint)
        return _load_rng_state

    _replace(cls, "create_accelerator_and_postprocess", after_accelerator)
    _replace(cls, "_wrap_model", wrap_once)
    _replace(cls, "create_scheduler", optimizer_before_scheduler)
    _replace(cls, "_load_rng_state", rng_state_allowlisted)
    for name in ("get_train_dataloader", "get_eval_dataloader", "get_test_dataloader"):
        _replace(cls, name, data_parallel_shards)


REPAIRS = [
    ClassRepair("transformers.training_args", "TrainingArguments", repair_training_arguments),
    ClassRepair("transformers.trainer", "Trainer", repair_trainer),
]


def install_transformers_repairs() -> None:
    """Install the repairs into transformers' ``TrainingArguments`` and ``Trainer`` (now, or when
    transformers defines them). Called by ``import smdistributed.modelparallel.torch``, which therefore
    refuses an installed transformers older than the supported floor, in one line naming the range."""
    require_supported_transformers()
    install(REPAIRS)
