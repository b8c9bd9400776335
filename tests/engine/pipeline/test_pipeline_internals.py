"""Pins every DeepSpeed private name the pipeline runner relies on (DeepSpeed 0.19.x).

The runner drives DeepSpeed's ``PipelineEngine`` below its public ``train_batch``: it executes its
own schedules (``_exec_schedule``), steps the optimizer itself (``_exec_optimizer_step``), wraps
the forward/backward instructions per engine (``_INSTRUCTION_MAP``, ``_exec_forward_pass``,
``_exec_backward_pass``, ``loss``), asks the last stage to compute the loss (``_compute_loss``) and
hands ``PipelineModule`` a precomputed split (``_partition_layers`` / ``_set_bounds`` / ``_topo``).
If a DeepSpeed upgrade renames or reshapes any of them, this file fails first, naming the
attribute and the runner code that needs it, instead of a pipeline test failing obscurely.
"""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("deepspeed")

from deepspeed.runtime.pipe import schedule as ds_schedule  # noqa: E402
from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: E402
from deepspeed.runtime.pipe.module import PipelineModule  # noqa: E402

ENGINE_METHODS = {
    "_exec_schedule": ("pipe_schedule",),
    "_exec_optimizer_step": (),
    "_exec_forward_pass": ("buffer_id",),
    "_exec_backward_pass": ("buffer_id",),
    "reset_activation_shape": (),
}
"""PipelineEngine method -> the parameters (after ``self``) the runner passes positionally."""


def _fail(name: str, why: str, user: str) -> str:
    return (f"DeepSpeed changed a private pipeline name smp2ds relies on: {name} {why}. "
            f"Update {user} for this DeepSpeed version.")


@pytest.mark.parametrize("name", sorted(ENGINE_METHODS))
def test_pipeline_engine_methods_keep_their_signatures(name):
    method = getattr(PipelineEngine, name, None)
    assert callable(method), _fail(f"PipelineEngine.{name}", "is gone", "engine/pipeline/runner.py")
    params = [p for p in inspect.signature(method).parameters if p != "self"]
    want = ENGINE_METHODS[name]
    assert tuple(params[:len(want)]) == want, _fail(f"PipelineEngine.{name}", f"now takes {params}, "
                                                    f"the runner passes {list(want)}", "engine/pipeline/runner.py")


def test_instruction_map_dispatches_forward_and_backward_through_the_table():
    table = getattr(PipelineEngine, "_INSTRUCTION_MAP", None)
    assert isinstance(table, dict), _fail("PipelineEngine._INSTRUCTION_MAP", "is not a class-level dict",
                                          "engine/pipeline/runner.py")
    assert table.get(ds_schedule.ForwardPass) is PipelineEngine._exec_forward_pass
    assert table.get(ds_schedule.BackwardPass) is PipelineEngine._exec_backward_pass
    # The runner's per-instance table only works if _exec_schedule looks it up through `self`.
    source = inspect.getsource(PipelineEngine._exec_schedule)
    assert "self._INSTRUCTION_MAP" in source, _fail("PipelineEngine._exec_schedule", "no longer reads "
                                                    "self._INSTRUCTION_MAP", "runner.py")


def test_engine_loss_and_compute_loss_flags_are_read_where_the_runner_sets_them():
    forward = inspect.getsource(PipelineEngine._exec_forward_pass)
    backward = inspect.getsource(PipelineEngine._exec_backward_pass)
    assert "self._compute_loss" in forward and "self.loss" in forward, _fail(
        "PipelineEngine._exec_forward_pass", "no longer reads _compute_loss / writes loss", "runner.py")
    assert "self.loss" in backward, _fail("PipelineEngine._exec_backward_pass", "no longer reads loss",
                                         "runner.py (GPipe loss per buffer)")


def test_pipeline_module_partitioning_hook():
    for name in ("_partition_layers", "_set_bounds"):
        assert callable(getattr(PipelineModule, name, None)), _fail(
            f"PipelineModule.{name}", "is gone", "engine/pipeline/module.py (PlannedPipelineModule)")
    init = inspect.getsource(PipelineModule.__init__)
    assert "self._partition_layers(" in init and "self._topo" in init, _fail(
        "PipelineModule.__init__", "no longer calls _partition_layers / sets _topo",
        "engine/pipeline/module.py")
    bounds = inspect.signature(PipelineModule._set_bounds).parameters
    assert {"start", "stop"} <= set(bounds), _fail("PipelineModule._set_bounds", f"takes {list(bounds)}",
                                                   "engine/pipeline/module.py")
