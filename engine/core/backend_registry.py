"""Choose the backend for a ``DistributedModel`` from the Plan (never from the raw config).

* ``plan.engine.pipeline.enabled``: :class:`smp2ds.engine.pipeline.backend.PipelineBackend` (with
  tensor parallelism too: it shards the model over each stage's tensor-parallel group,
  :mod:`smp2ds.engine.tensor_parallel.stages`);
* ``plan.engine.tensor_parallel.enabled``: :mod:`smp2ds.engine.tensor_parallel.backend` (tensor
  parallelism with DDP or ZeRO-1 over the reduced-data-parallel group); with ``mics`` also enabled
  :class:`smp2ds.engine.tensor_parallel.sharded_data.TensorShardedBackend` (ZeRO-3 over shard
  groups inside the rdp group);
* ``plan.engine.mics.enabled``: :class:`smp2ds.engine.mics.backend.MicsBackend`;
* otherwise :class:`smp2ds.engine.data_parallel.backend.DataParallelBackend` (DDP, or ZeRO-1 for
  ``shard_optimizer_state``).

Backend modules are imported only when chosen: the pipeline one pulls in DeepSpeed's pipeline
package, which plain data-parallel scripts never need.
"""

from __future__ import annotations

from typing import Any

from smp2ds.engine.core.backend import Backend


def make_backend(module: Any, state: Any) -> Backend:
    """The backend that runs ``module`` under the current Plan."""
    # Each return below is where mypy (.ci/typecheck) checks that backend class against the protocol.
    engine = state.plan.engine
    microbatches = int(engine["microbatches"])
    if engine["pipeline"]["enabled"]:
        from smp2ds.engine.pipeline.backend import PipelineBackend

        return PipelineBackend(module, state=state, microbatches=microbatches)
    if engine["tensor_parallel"]["enabled"] and engine["mics"]["enabled"]:
        from smp2ds.engine.tensor_parallel.sharded_data import TensorShardedBackend

        return TensorShardedBackend(module, state=state, microbatches=microbatches)
    if engine["tensor_parallel"]["enabled"]:
        from smp2ds.engine.tensor_parallel.backend import create_backend

        return create_backend(module, state=state, microbatches=microbatches)
    if engine["mics"]["enabled"]:
        from smp2ds.engine.mics.backend import MicsBackend

        return MicsBackend(module, state=state, microbatches=microbatches)
    from smp2ds.engine.data_parallel.backend import DataParallelBackend

    return DataParallelBackend(module, dict(state.plan.deepspeed), microbatches=microbatches)
