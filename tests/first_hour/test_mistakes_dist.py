"""The likely first-hour mistakes that need a model and real ranks, each made on 1-2 CPU ranks.

Every rank is a real process (``tests/_dist.py``, gloo); the test reads what the mistake raised and
holds the message to the bar: the cause and the fix, in at most three lines
(``docs/troubleshooting.md`` lists the same mistakes). Configuration mistakes that end before a model
exists are in ``test_mistakes.py``, run as whole scripts.
"""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.first_hour import workers as w
from tests.first_hour.bar import assert_names_cause_and_fix

pytestmark = pytest.mark.slow


def test_no_smp_parameters_on_two_ranks_names_the_missing_variable():
    for kind, message in run_ranks(w.no_parameters, 2):
        assert kind == "SMPConfigError"
        assert message.index("SM_HP_MP_PARAMETERS is not set") < message.index("/ddp")  # the cause comes first
        assert_names_cause_and_fix(message.split("\n  /ddp")[0], ["SM_HP_MP_PARAMETERS is not set"],
                                   ["smp2ds launch --config FILE"])


def test_optimizer_from_the_unwrapped_model():
    kind, message = run_ranks(w.optimizer_from_unwrapped_model, 1)[0]
    assert kind == "SMPInvalidArgumentError"
    assert_names_cause_and_fix(message, ["do not belong to the DistributedModel"], ["model.parameters() after wrapping"])


def test_backward_outside_smp_step():
    kind, message = run_ranks(w.backward_outside_step, 1)[0]
    assert kind == "BwdExecutionNotInStepFnError"
    assert_names_cause_and_fix(message, ["model.backward"], ["inside an @smp.step function"])


def test_pipeline_over_an_untraceable_module():
    for kind, message in run_ranks(w.pipeline_over_untraceable_module, 2):
        assert kind in ("UnsupportedModelError", "SegmentError")
        assert_names_cause_and_fix(message, ["Branchy", "torch.fx"], ["nn.Sequential"])


def test_tensor_parallel_degree_that_does_not_divide_the_heads():
    for kind, message in run_ranks(w.tp_degree_not_dividing_heads, 2):
        assert kind == "SMPUnsupportedError"
        assert_names_cause_and_fix(
            message, ["GPT2LMHeadModel", "tensor_parallel_degree 2 must divide the attention head counts", "n_head=3"],
            ["choose a degree that divides them"])


def test_checkpoint_from_another_layout(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(w.save_sharded_checkpoint, 2, path)
    kind, message = run_ranks(w.resume_at_another_layout, 1, path)[0]
    assert kind == "IncompatibleCheckpointFoundError"
    assert_names_cause_and_fix(message, ["different data-parallel layout", "saved 2, now 1"],
                               ["load_optimizer=False"])
