"""``smdistributed.modelparallel.torch.utils``: the helpers SMP's public scripts import (``rmsg``,
``get_distribution_axis``), re-exported from ``smp2ds.engine.api.script_utils``."""

from smp2ds.engine.api.script_utils import get_distribution_axis, rmsg

__all__ = ["get_distribution_axis", "rmsg"]
