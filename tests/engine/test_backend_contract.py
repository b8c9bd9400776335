"""The Backend contract at class level: capability flags on every backend, no inheritance between
the data-parallel and the pipeline backend, the pipeline's refusal to rebuild its engine.

Conformance of every member's signature is mypy's job (``.ci/typecheck``); the behaviour behind the
flags is checked through the SMP API in ``test_backends_dist.py`` (forward outside a step, clipping).
"""

from __future__ import annotations

import pytest

from smp2ds.engine.core.backend import Backend
from smp2ds.engine.data_parallel.backend import DataParallelBackend
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.mics.backend import MicsBackend
from smp2ds.engine.pipeline.backend import PipelineBackend
from smp2ds.engine.tensor_parallel.backend import TensorParallelBackend
from smp2ds.engine.tensor_parallel.sharded_data import TensorShardedBackend
from smp2ds.translator.backend_choice import BACKENDS

FLAGS = ("cast_io", "collective_state_dict", "can_rebuild_optimizer", "forward_needs_step", "clips_in_step")

# (cast_io, collective_state_dict, can_rebuild_optimizer, forward_needs_step, clips_in_step): what each
# engine does, as the README describes it (SMP's behaviour per parallelism).
EXPECTED = {
    DataParallelBackend: (True, False, True, False, False),
    MicsBackend: (True, True, True, False, True),
    TensorParallelBackend: (True, True, True, False, False),
    TensorShardedBackend: (True, True, True, False, True),
    PipelineBackend: (False, False, False, True, False),
}


def test_protocol_declares_every_capability_flag():
    assert set(FLAGS) <= set(Backend.__annotations__)


@pytest.mark.parametrize("backend", list(EXPECTED), ids=lambda c: c.__name__)
def test_every_backend_sets_each_capability_flag(backend):
    values = tuple(getattr(backend, flag) for flag in FLAGS)
    assert all(isinstance(v, bool) for v in values)
    assert values == EXPECTED[backend]


def test_pipeline_backend_shares_functions_not_a_base_class():
    assert DataParallelBackend not in PipelineBackend.__mro__


def test_pipeline_backend_refuses_to_rebuild_and_leaves_the_groups_alone():
    backend = object.__new__(PipelineBackend)  # no runner needed: the refusal comes first
    regrouped = []
    with pytest.raises(SMPUnsupportedError, match="add_param_group with pipeline parallelism"):
        backend.rebuild(None, None, lambda: regrouped.append(True))
    assert regrouped == []


def test_each_backend_is_named_as_the_planner_names_it():
    # make_backend builds the class whose name the Plan carries; every choice has exactly one class
    assert sorted(backend.name for backend in EXPECTED) == sorted(BACKENDS)
