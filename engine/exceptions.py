"""SMP's exception classes, so code written against SMP can catch what smp2ds raises.

SMP v1 exposed ~80 specific classes under ``smdistributed.modelparallel.{torch,backend}.exceptions``
(the SageMaker training toolkit imports both modules and classifies failures by class name).
We keep SMP's base classes and the specific classes that real clients and this engine use.
``SMPConfigError`` is the translator's error (it carries every configuration ``Issue``), so an
invalid configuration raised by ``smp.init`` is caught by ``except SMPConfigError`` either way.
"""

from __future__ import annotations

from smp2ds.translator.issues import SMPConfigError

__all__ = [
    "BwdExecutionNotInStepFnError",
    "DDPNotEnabledError",
    "DistributedModelNotWrappedError",
    "DistributedModelWrappedError",
    "FwdExecutionNotInStepFnError",
    "IncompatibleCheckpointFoundError",
    "IncompatibleCheckpointRankFoundError",
    "InvalidCommGroupError",
    "InvalidPartitionIDError",
    "MissingCheckpointFilesError",
    "MissingDistributedModelError",
    "ModelNotPartitionedError",
    "MultipleDistributedModelError",
    "NotInitializedError",
    "RankLostError",
    "SMPAMPError",
    "SMPCheckpointError",
    "SMPConfigError",
    "SMPError",
    "SMPInvalidArgumentError",
    "SMPRuntimeError",
    "SMPUnsupportedError",
    "SMPValidationError",
    "StepFunctionCalledError",
    "TensorSplitError",
    "WorkerSizeError",
]


class SMPError(Exception):
    """Marker base shared by every smp2ds runtime error (not a class SMP had)."""


class SMPValidationError(SMPError, ValueError):
    """A call was made with arguments SMP does not accept."""


class SMPInvalidArgumentError(SMPValidationError):
    """An argument has the wrong type or value."""


class SMPUnsupportedError(SMPError, RuntimeError):
    """A feature SMP had that smp2ds does not provide (the message says why and what to use)."""


class SMPRuntimeError(SMPError, RuntimeError):
    """Something went wrong while running."""


class NotInitializedError(SMPRuntimeError):
    """An ``smp`` function that needs ``smp.init()`` was called before it."""


class DDPNotEnabledError(SMPRuntimeError):
    """A process-group getter was called while the ``ddp`` config key is False."""


class WorkerSizeError(SMPValidationError):
    """The process count does not fit the configured degrees."""


class InvalidCommGroupError(SMPValidationError):
    """``group`` is not an ``smp.CommGroup`` value."""


class TensorSplitError(SMPValidationError):
    """A step input cannot be split into ``microbatches`` equal pieces."""


class StepFunctionCalledError(SMPRuntimeError):
    """An operation that must happen before the first ``smp.step`` call came after it."""


class FwdExecutionNotInStepFnError(SMPRuntimeError):
    """The model's forward ran outside an ``smp.step`` function where that is not allowed."""


class BwdExecutionNotInStepFnError(SMPRuntimeError):
    """``model.backward`` was called outside an ``smp.step`` function."""


class ModelNotPartitionedError(SMPRuntimeError):
    """A ``local_*`` accessor was used before the model was partitioned (first step)."""


class MultipleDistributedModelError(SMPRuntimeError):
    """A second ``DistributedModel`` was created in one process (call ``smp.reset()`` first)."""


class InvalidPartitionIDError(SMPValidationError):
    """``smp.partition(i)`` / ``set_partition`` got an index outside ``0..pp-1``."""


class DistributedModelWrappedError(SMPRuntimeError):
    """An operation that must precede ``DistributedModel`` came after it."""


class DistributedModelNotWrappedError(SMPRuntimeError):
    """An operation that needs a ``DistributedModel`` came before it."""


class MissingDistributedModelError(DistributedModelNotWrappedError):
    """``smp.step`` or ``DistributedOptimizer`` was used before a ``DistributedModel`` existed."""


class SMPCheckpointError(SMPRuntimeError):
    """A checkpoint could not be written or read."""


class MissingCheckpointFilesError(SMPCheckpointError):
    """Some per-rank checkpoint files are missing."""


class IncompatibleCheckpointFoundError(SMPCheckpointError):
    """The checkpoint was written for different degrees than the current run."""


class IncompatibleCheckpointRankFoundError(IncompatibleCheckpointFoundError):
    """A per-rank file names a rank that does not exist in the current run."""


class SMPAMPError(SMPRuntimeError):
    """``smp.amp.GradScaler`` misuse."""


class RankLostError(SMPRuntimeError):
    """Another rank stopped (died or hung); raised or reported instead of waiting forever."""
