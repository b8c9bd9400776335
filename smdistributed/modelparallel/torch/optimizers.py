"""``smdistributed.modelparallel.torch.optimizers``: SMP's ``FusedAdam``, ``FusedLAMB`` and ``FusedNovoGrad``
(re-exported from ``smp2ds.engine.optimizers``)."""

from smp2ds.engine.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad

__all__ = ["FusedAdam", "FusedLAMB", "FusedNovoGrad"]
