"""``SMP2DS_COMPILE=1``: compile the model through DeepSpeed's ``engine.compile()`` before the first step.

An smp2ds setting, not an SMP key (:mod:`smp2ds.translator.smp2ds_settings`). DeepSpeed's ``compile()`` runs
``torch.compile`` on the module it wraps, in place, so the compiled forward stays with the module even if the
engine is rebuilt around a new optimizer. Pipelines are refused: their stages run inside DeepSpeed's
pipeline schedule, which this switch does not compile.
"""

from __future__ import annotations

import os
from typing import Any

from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import SMPInvalidArgumentError, SMPUnsupportedError
from smp2ds.translator.smp2ds_settings import COMPILE_ENV, compile_requested


def check_setting(pipeline: bool) -> bool:
    """Whether ``SMP2DS_COMPILE`` asks for compilation, read once at ``smp.init`` (kept as
    ``state.compile_model``): a value other than 0 or 1, and compilation with a ``pipeline``, are refused there,
    naming the variable."""
    try:
        wanted = compile_requested(os.environ)
    except ValueError as err:
        raise SMPInvalidArgumentError(str(err)) from None
    if wanted and pipeline:
        raise SMPUnsupportedError(f"{COMPILE_ENV}=1 with pipeline_parallel_degree > 1: DeepSpeed's pipeline engine "
                                  f"runs the stages itself and is not compiled by smp2ds; unset {COMPILE_ENV}")
    return wanted


def ensure_compiled(model: Any) -> None:
    """Compile ``model``'s DeepSpeed engine once when ``SMP2DS_COMPILE=1`` (nothing otherwise; called per step)."""
    if not state.compile_model:
        return
    backend = model.backend
    backend.ensure_built()
    if not backend.engine.is_compiled:
        backend.engine.compile()
