"""``smp.amp`` (re-exported from ``smp2ds.engine.api.amp``)."""

from smp2ds.engine.api.amp import GradScaler

__all__ = ["GradScaler"]
