"""The tensor-parallel backend's entry point (a scaffold: see the package docstring)."""

from __future__ import annotations

from typing import Any

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.tensor_parallel import UNSUPPORTED_REASON


def create_backend(module: Any, *, state: Any, microbatches: int) -> Any:
    """Refuse: ``smp.init`` already rejects tensor parallelism, so only a hand-made Plan gets here."""
    raise SMPUnsupportedError(f"tensor_parallel_degree={state.plan.topology['tensor_parallel_degree']}: "
                              f"{UNSUPPORTED_REASON}")
