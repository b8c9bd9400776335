"""``import smdistributed.modelparallel.torch as smp``: the SMP v1 PyTorch API, on DeepSpeed.

No logic lives here: every name comes from ``smp2ds.engine``.
"""
# ruff: noqa: I001 - the decorator `step` / function `checkpoint` are imported explicitly after the star import

from smp2ds.engine import *
from smp2ds.engine import __all__  # noqa: F401 - re-exported: star-imports of this package see the same names
from smp2ds.engine import checkpoint, step  # noqa: F401  (the decorator / activation checkpoint, as in SMP)

from . import amp, exceptions, model, nn  # noqa: F401

# transformers imports this package for its SageMaker-model-parallel path: repair that path now.
from smp2ds.engine.api import hf_trainer_repairs as _hf_trainer_repairs

_hf_trainer_repairs.install_transformers_repairs()
