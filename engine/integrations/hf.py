"""Hugging Face ``Trainer`` on the SageMaker-model-parallel path, run by smp2ds.

A plain ``transformers.Trainer`` with plain ``TrainingArguments`` works unchanged: importing
``smdistributed.modelparallel.torch`` (transformers does it when the environment says SMP)
installs the repairs transformers' SMP code path needs (`smp2ds.engine.api.hf_trainer_repairs`).

``SMPTrainer`` and ``SMPCPUTrainingArguments`` are the names earlier smp2ds releases asked
scripts to use; they are now the stock classes, kept so those scripts keep running.
"""

from __future__ import annotations

from transformers import Trainer, TrainingArguments

__all__ = ["SMPCPUTrainingArguments", "SMPTrainer"]

SMPTrainer = Trainer
SMPCPUTrainingArguments = TrainingArguments
