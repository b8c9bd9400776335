"""Choose the backend for a ``DistributedModel`` from the configuration.

* ``pipeline_parallel_degree > 1``: :class:`~smp2ds.engine.pipeline.backend.PipelineBackend`
  drives ``smp2ds.engine.pipeline.build_pipeline(...)``'s ``PipelineRunner``;
* ``sharded_data_parallel_degree > 1``: :class:`~smp2ds.engine.mics.backend.MicsBackend` builds
  the engine with ``smp2ds.engine.mics.initialize`` on the groups ``smp.init`` created;
* otherwise :class:`~smp2ds.engine.data_parallel.backend.DataParallelBackend` (DDP, or ZeRO-1 for
  ``shard_optimizer_state``).

A subpackage may instead expose ``create_backend(module, *, state, plan, microbatches)``
returning an object with ``DataParallelBackend``'s interface; it then takes precedence. If the
subpackage is missing or raises ``NotImplementedError``, the user gets an
``SMPUnsupportedError`` naming the configuration key.
"""

from __future__ import annotations

import importlib
from typing import Any

from smp2ds.engine.data_parallel.backend import DataParallelBackend
from smp2ds.engine.exceptions import SMPUnsupportedError

_FEATURES = {
    "pipeline": ("pipeline_parallel_degree", "pipeline parallelism"),
    "mics": ("sharded_data_parallel_degree", "sharded data parallelism (MiCS)"),
}


def _from_subpackage(name: str, module: Any, state: Any, microbatches: int) -> Any:
    key, what = _FEATURES[name]
    value = getattr(state.cfg, key)
    try:
        package = importlib.import_module(f"smp2ds.engine.{name}")
        create = getattr(package, "create_backend", None)
        if create is not None:
            return create(module, state=state, plan=state.plan, microbatches=microbatches)
        if name == "mics":
            from smp2ds.engine.mics.backend import MicsBackend

            return MicsBackend(module, state=state, microbatches=microbatches)
        if name == "pipeline":
            from smp2ds.engine.pipeline.backend import PipelineBackend

            return PipelineBackend(module, state=state, microbatches=microbatches)
        initialize = getattr(package, "initialize", None)
        if initialize is None:
            raise NotImplementedError(f"smp2ds.engine.{name} exposes neither create_backend nor initialize")
        return DataParallelBackend(module, dict(state.plan.deepspeed), microbatches=microbatches,
                                   initialize=initialize, init_kwargs={"state": state, "plan": state.plan})
    except ModuleNotFoundError as exc:
        if exc.name != f"smp2ds.engine.{name}":
            raise
        detail = "this smp2ds installation has no such engine"
    except NotImplementedError as exc:
        detail = str(exc) or "not implemented"
    raise SMPUnsupportedError(f"{key}={value} needs {what}, which is not available: {detail}")


def make_backend(module: Any, state: Any) -> Any:
    """The backend that runs ``module`` under the current configuration."""
    cfg = state.cfg
    microbatches = int(cfg.microbatches)
    if int(cfg.pipeline_parallel_degree) > 1:
        return _from_subpackage("pipeline", module, state, microbatches)
    if int(cfg.tensor_parallel_degree) > 1:
        raise SMPUnsupportedError(
            f"tensor_parallel_degree={cfg.tensor_parallel_degree}: tensor parallelism is not implemented by this "
            "engine yet; use tensor_parallel_degree 1 (data parallelism, sharded data parallelism or pipelines)"
        )
    if int(cfg.sharded_data_parallel_degree) > 1:
        return _from_subpackage("mics", module, state, microbatches)
    return DataParallelBackend(module, dict(state.plan.deepspeed), microbatches=microbatches)
