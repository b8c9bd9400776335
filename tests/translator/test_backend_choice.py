"""The planner chooses the engine backend (``/engine/backend``) and ``smp2ds explain`` shows it.

The engine's registry builds the backend the Plan names (``tests/engine/api/test_backend_contract.py``
checks the names against the backend classes; the multi-rank tests check the built backend equals
the Plan's choice), so these cases pin the choice per parallelism.
"""

from __future__ import annotations

import json

import pytest

from smp2ds.cli import main as cli_main
from smp2ds.translator.backend_choice import BACKENDS
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan

CASES = [
    ({"ddp": True}, 4, "deepspeed-data-parallel"),
    ({"ddp": True, "shard_optimizer_state": True}, 4, "deepspeed-data-parallel"),
    ({"ddp": True, "sharded_data_parallel_degree": 2}, 4, "mics"),
    ({"ddp": True, "tensor_parallel_degree": 2}, 4, "tensor-parallel"),
    ({"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True}, 4,
     "tensor-parallel+mics"),
    ({"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2}, 4, "pipeline"),
    ({"ddp": True, "pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}, 4, "pipeline"),
]


@pytest.mark.parametrize(("params", "world", "expected"), CASES, ids=[c[2] + f"-{i}" for i, c in enumerate(CASES)])
def test_the_plan_names_the_backend_for_each_parallelism(params, world, expected):
    layout = Layout(world_size=world)
    choice = plan(normalize(params, layout), layout).engine["backend"]
    assert choice["name"] == expected
    assert choice["reason"]


def test_every_backend_is_chosen_by_some_configuration():
    assert {expected for _, _, expected in CASES} == set(BACKENDS)


def test_explain_shows_the_choice(tmp_path, capsys):
    config = tmp_path / "smp.json"
    config.write_text(json.dumps({"ddp": True, "sharded_data_parallel_degree": 2}))
    assert cli_main(["explain", str(config), "--world-size", "4", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["backend"]["name"] == "mics"
    assert cli_main(["explain", str(config), "--world-size", "4"]) == 0
    assert "\nbackend: mics\n" in capsys.readouterr().out


# ---- the tensor-parallel part of the Plan, typed ---------------------------------------------------


def test_tensor_parallel_settings_read_back_from_the_plan_with_the_values_given():
    from smp2ds.translator.tensor_parallel import TensorParallelSettings

    layout = Layout(world_size=4)
    params = {"ddp": True, "tensor_parallel_degree": 2, "tensor_parallel_seed": 7, "optimize": "memory"}
    settings = plan(normalize(params, layout), layout).engine_settings.tensor_parallel
    assert settings == TensorParallelSettings(enabled=True, degree=2, implementation="smp2ds-megatron", seed=7,
                                              optimize="memory")
    with pytest.raises(AttributeError):
        settings.seed = 3  # frozen: the engine reads the Plan, never changes it


def test_the_engine_takes_its_tensor_parallel_defaults_from_the_plan_type():
    from smp2ds.engine.nn.parallel.group import SINGLE
    from smp2ds.translator.tensor_parallel import TensorParallelSettings

    layout = Layout(world_size=2)
    settings = plan(normalize({"ddp": True}, layout), layout).engine_settings.tensor_parallel
    assert settings == TensorParallelSettings()  # tensor parallelism off: every default
    assert SINGLE.optimize == settings.optimize
