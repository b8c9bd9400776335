"""``smdistributed.modelparallel.torch.state_mod``: SMP's process-global ``state`` (``state.cfg``,
``state.model``, ``state.optimizer``, ``state.module_manager``, the process groups)."""

from smp2ds.engine.core.state import state

__all__ = ["state"]
