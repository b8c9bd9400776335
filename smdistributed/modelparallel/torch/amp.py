"""``smp.amp`` (re-exported from ``smp2ds.engine.amp``)."""

from smp2ds.engine.amp import GradScaler

__all__ = ["GradScaler"]
