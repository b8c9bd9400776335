"""``smp.delay_param_initialization()`` for sharded data parallelism, read from the engine state.

The engine core (``engine/creation.py``) looks up ``mics.delay_param_initialization(enabled=...)``
and enters it around model construction when ``sharded_data_parallel_degree > 1``. Parameters
are then born partitioned over the shard group, with the same ``MicsGroups`` object the MiCS
backend gets later (``MicsGroups.create`` is idempotent for equal arguments, and the arguments
here mirror ``engine/backend_mics.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .api import mics_init_context
from .groups import MicsGroups


def groups_from_state(state: Any) -> MicsGroups:
    """The MiCS groups for the initialised ``smp`` state (collective on first call)."""
    cfg = state.cfg
    return MicsGroups.create(state.groups.topology, int(cfg.sharded_data_parallel_degree), rank=state.groups.rank,
                             ranks_per_node=state.launch.local_size,
                             hierarchical=bool(cfg.sdp_hierarchical_allgather))


def init_config(ds_config: dict) -> dict:
    """The plan's DeepSpeed config, completed with batch keys ``zero.Init``'s config parser requires."""
    cfg = dict(ds_config)
    if not any(k in cfg for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        cfg["train_micro_batch_size_per_gpu"] = 1
    return cfg


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Create parameters already sharded in the shard group (SMP ``delayed_parameter_initialization``)."""
    from smp2ds.engine.state import state

    if not enabled:
        yield
        return
    groups = groups_from_state(state)
    with mics_init_context(init_config(dict(state.plan.deepspeed)), groups):
        yield
