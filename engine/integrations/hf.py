"""Hugging Face ``Trainer``'s SageMaker-model-parallel path on smp2ds (transformers 5).

With ``SM_HP_MP_PARAMETERS`` (containing ``partitions``) and ``SM_FRAMEWORK_PARAMS``
(``sagemaker_mpi_enabled``) set, transformers imports ``smdistributed.modelparallel.torch``
(smp2ds), calls ``smp.init()`` and takes its SMP code path. Two adaptations:

* :class:`SMPCPUTrainingArguments`, only on machines without CUDA: ``TrainingArguments``'
  SMP branch picks ``torch.device("cuda", smp.local_rank())`` and calls
  ``torch.cuda.set_device`` (its ``use_cpu=True`` branch leaves the device unset under SMP).
  This subclass replaces that device choice with the CPU (for accelerate too) and nothing else.
* :class:`SMPTrainer`, on every machine: transformers 5 broke its own SMP path (no optimizer is
  ever created and a given one is never wrapped, fp32 clipping ignores sharded optimizer state,
  evaluation wraps the model twice) and accelerate shards the data over pipeline stages; this
  subclass repairs those and otherwise is the stock ``Trainer``.

Import this module only after the two variables are set: importing transformers'
``training_args`` runs ``smp.init()`` when SMP is enabled.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.utils import is_sagemaker_mp_enabled

from smp2ds.engine.core.optimizer import DistributedOptimizer
from smp2ds.engine.core.state import state

__all__ = ["SMPCPUTrainingArguments", "SMPTrainer"]


class SMPCPUTrainingArguments(TrainingArguments):
    """``TrainingArguments`` whose device is the CPU when SMP is enabled and CUDA is absent.

    On GPU machines no adaptation is needed: use plain ``TrainingArguments`` (this class then
    behaves exactly like it, since it defers to the parent whenever CUDA is available or SMP is
    not enabled).
    """

    @cached_property
    def _setup_devices(self) -> torch.device:
        if not is_sagemaker_mp_enabled() or torch.cuda.is_available():
            return TrainingArguments._setup_devices.func(self)
        from accelerate.state import AcceleratorState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        # accelerate shards the Trainer's data loaders by its own process count. On GPUs it finds
        # the launcher's LOCAL_RANK (smp.init exports it) and counts every rank; without CUDA it
        # only does so when told to use the CPU. Its process state adopts the process group
        # smp.init created (nothing is initialised twice).
        PartialState(cpu=True)
        # As transformers' SMP branch: no `distributed_state`, so world size and ranks come from
        # smp.dp_size()/smp.dp_rank(); one device per process.
        self.distributed_state = None
        self._n_gpu = 1
        return torch.device("cpu")


class SMPTrainer(Trainer):
    """``Trainer`` with four repairs to transformers 5's SMP path (needed on GPUs as on CPUs).

    1. Optimizer creation. ``_prepare_for_training`` delays optimizer creation under SMP but
       then, the model being wrapped in ``smp.DistributedModel``, only runs
       ``accelerator.prepare`` on the still-missing optimizer, and ``create_scheduler`` fails on
       ``None`` (real SMP fails the same way); an optimizer given as ``optimizers=(opt, ...)``
       is never wrapped in ``smp.DistributedOptimizer``. Here the optimizer is created (and
       wrapped by ``create_optimizer``), or the given one wrapped, right before the scheduler,
       after the model was wrapped: the order transformers 4.x used.
    2. Gradient clipping and the logged gradient norm. Stock transformers routes only fp16 runs
       to ``optimizer.clip_master_grads``; fp32 runs clip ``model.parameters()``' ``.grad``,
       which DeepSpeed's ZeRO-1 (``shard_optimizer_state``) empties after the reduction, so
       nothing was clipped and the norm logged as 0. smp2ds's ``clip_master_grads`` handles
       every precision and ZeRO stage, so it is used for all SMP runs.
    3. Evaluation after (or before) training. ``evaluation_loop`` calls ``_wrap_model(self.model)``
       with the unwrapped model, and transformers 5 checks only its argument for an existing
       ``DistributedModel`` (4.x checked ``self.model_wrapped``), so it wraps the model a second
       time, which SMP forbids. The one ``DistributedModel`` of the process is reused instead.
    4. Which rank gets which batch. accelerate shards the training data over all processes, but
       SMP shards it over the data-parallel ranks (``args.world_size`` = ``smp.dp_size()``): the
       stages of one pipeline must see the same batch (SMP's pipeline followers ignored their
       own inputs; DeepSpeed's last stage reads its labels). The shard is re-pointed at the
       data-parallel rank, as transformers itself does for its ``BatchRebalanceSampler`` (for
       training and evaluation data; accelerate's metric gather then collects one identical copy
       per pipeline stage, which leaves means unchanged).

    Outside SMP every method defers to the stock ``Trainer``.
    """

    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        loader = super()._get_dataloader(*args, **kwargs)
        shard = getattr(loader, "batch_sampler", None)
        if is_sagemaker_mp_enabled() and hasattr(shard, "num_processes") and hasattr(shard, "process_index"):
            shard.num_processes, shard.process_index = self.args.world_size, self.args.process_index
        return loader

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        if is_sagemaker_mp_enabled():
            existing = state.model  # smp.state.model: the process's one DistributedModel
            if existing is not None and (model is existing or model is existing.module):
                return existing
        return super()._wrap_model(model, training, dataloader)

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if optimizer is None and is_sagemaker_mp_enabled() and not isinstance(self.optimizer, DistributedOptimizer):
            if self.optimizer is None:
                self.create_optimizer()
            else:
                # Trainer(optimizers=(opt, ...)): accelerate wrapped it (AcceleratedOptimizer adds
                # nothing under SMP); SMP needs the user's optimizer inside DistributedOptimizer.
                user = self.optimizer
                if type(user).__name__ == "AcceleratedOptimizer":
                    user = user.optimizer
                self.optimizer = DistributedOptimizer(user)
        return super().create_scheduler(num_training_steps, optimizer)

    def _smp_clip(self) -> Any:
        clip = getattr(self.optimizer, "clip_master_grads", None)
        return clip if is_sagemaker_mp_enabled() else None

    def _clip_grad_norm(self, model: torch.nn.Module) -> Any:
        clip = self._smp_clip()
        return clip(self.args.max_grad_norm) if clip is not None else super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        clip = self._smp_clip()
        if grad_norm is None and clip is not None:
            grad_norm = clip(float("inf"))  # the norm only: clipping at inf changes nothing
        return super()._get_grad_norm(model, grad_norm)
