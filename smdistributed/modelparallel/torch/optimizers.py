"""``smdistributed.modelparallel.torch.optimizers``: SMP's ``FusedAdam``, ``FusedLAMB`` and ``FusedNovoGrad``
(re-exported from ``smp2ds.engine.api.optimizers``)."""

from smp2ds.engine.api.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad

__all__ = ["FusedAdam", "FusedLAMB", "FusedNovoGrad"]
