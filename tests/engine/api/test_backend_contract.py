"""The Backend contract: capability flags on every backend the factory can build (the data-parallel backend
with replicated or MiCS-sharded parameters, and the pipeline backend; the first two also with a
tensor-parallel model), no inheritance between backends, the pipeline's refusal to rebuild its engine.

Conformance of every member's signature is mypy's job (``.ci/typecheck``); the behaviour behind the
flags is checked through the SMP API in ``test_backends_dist.py`` (forward outside a step, clipping).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from smp2ds.engine.core.backend import Backend
from smp2ds.engine.data_parallel.backend import DataParallelBackend
from smp2ds.engine.data_parallel.replicated import ReplicatedParameters
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.mics.sharding import MicsSharding
from smp2ds.engine.pipeline.backend import PipelineBackend
from smp2ds.translator.backend_choice import BACKENDS

FLAGS = ("cast_io", "collective_state_dict", "can_rebuild_optimizer", "forward_needs_step", "clips_in_step")

# A sharded model's view as far as the constructors look at it (its size and whether the group shares one
# batch); what the view does is tested on real ranks (tests/engine/tensor_parallel/test_tensor_parallel_dist.py and others).
SHARDED = SimpleNamespace(size=2, group=SimpleNamespace(prescaled_batch=True))
GROUPS = SimpleNamespace()  # MiCS shard groups: not read until the engine is built


def _data_parallel(view=None):
    sharding = ReplicatedParameters((0, 1), tensor_parallel=view)
    return DataParallelBackend(torch.nn.Linear(2, 2), {}, microbatches=1, sharding=sharding)


def _mics(view=None):
    sharding = MicsSharding(GROUPS, view)
    return DataParallelBackend(torch.nn.Linear(2, 2), {}, microbatches=1, sharding=sharding)


# name -> (build one, (cast_io, collective_state_dict, can_rebuild_optimizer, forward_needs_step, clips_in_step)):
# what each engine does, as the README describes it (SMP's behaviour per parallelism).
EXPECTED = {
    "deepspeed-data-parallel": (_data_parallel, (True, False, True, False, False)),
    "mics": (_mics, (True, True, True, False, True)),
    "tensor-parallel": (lambda: _data_parallel(SHARDED), (True, True, True, False, False)),
    "tensor-parallel+mics": (lambda: _mics(SHARDED), (True, True, True, False, True)),
    "pipeline": (lambda: object.__new__(PipelineBackend), (False, False, False, True, False)),
}


def test_protocol_declares_every_capability_flag():
    assert set(FLAGS) <= set(Backend.__annotations__)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_backend_sets_each_capability_flag(name):
    build, expected = EXPECTED[name]
    backend = build()
    values = tuple(getattr(backend, flag) for flag in FLAGS)
    assert all(isinstance(v, bool) for v in values)
    assert values == expected
    assert backend.name == name  # make_backend builds, for each name the Plan may carry, a backend of that name


def test_backends_share_functions_not_base_classes():
    # one class drives the in-process engines (placement of parameters is a ParameterSharding it is given),
    # one the pipeline engine; neither derives from another backend
    assert DataParallelBackend.__mro__ == (DataParallelBackend, object)
    assert PipelineBackend.__mro__ == (PipelineBackend, object)
    assert MicsSharding.__mro__ == (MicsSharding, object) and ReplicatedParameters.__mro__[1:] == (object,)


def test_pipeline_backend_refuses_to_rebuild_and_leaves_the_groups_alone():
    backend = object.__new__(PipelineBackend)  # no runner needed: the refusal comes first
    regrouped = []
    with pytest.raises(SMPUnsupportedError, match="add_param_group with pipeline parallelism"):
        backend.rebuild(None, None, lambda: regrouped.append(True))
    assert regrouped == []


def test_the_planner_names_exactly_these_backends():
    assert sorted(EXPECTED) == sorted(BACKENDS)


def test_mics_with_tensor_parallelism_refuses_a_group_that_joins_batches():
    joining = SimpleNamespace(size=2, group=SimpleNamespace(prescaled_batch=False))
    with pytest.raises(SMPUnsupportedError, match="needs prescaled_batch: true"):
        _mics(joining)


def test_an_unmarked_model_is_not_looked_at_by_the_transformer_replacement():
    # a fresh interpreter: other tests import the replacement module
    code = ("import sys, torch\n"
            "from smp2ds.engine.api.backend_factory import prepare_module\n"
            "from smp2ds.engine.nn.parallel import marks\n"
            "from smp2ds.engine.nn.parallel.context import ParallelContext\n"
            "plain = torch.nn.Sequential(torch.nn.Linear(2, 2))\n"
            "assert prepare_module(plain, ParallelContext()) is plain\n"
            "assert 'smp2ds.engine.tensor_parallel.transformer_replacement' not in sys.modules\n"
            "marks.set_tensor_parallelism(plain)\n"
            "assert prepare_module(plain, ParallelContext()) is plain\n"  # marked without transformer settings: sharded, not replaced
            "assert 'smp2ds.engine.tensor_parallel.transformer_replacement' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
