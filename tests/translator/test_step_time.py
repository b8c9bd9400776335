"""``translator/tools/step_time.py``: the step-time terms ``explain --fit`` ranks layouts by, each against the
arithmetic it claims."""

from __future__ import annotations

import pytest

from smp2ds.translator.tools.step_time import DeviceRates, StepWork, pipeline_send_bytes, step_time

DEVICE = DeviceRates(flops=1e12, in_node_bytes=1e9, cross_node_bytes=1e8, in_node_latency=1e-5,
                     cross_node_latency=2e-5, label="test")


def _work(**changes: object) -> StepWork:
    base = {"parameters": 1e9, "tokens_per_rank": 1000, "tensor_parallel": 1, "pipeline_stages": 1, "microbatches": 1,
            "prescaled_batch": False, "activation_checkpointing": False, "data_parallel_in_node_bytes": 0.0,
            "data_parallel_cross_node_bytes": 0.0, "tensor_parallel_bytes": 0.0, "pipeline_send_bytes": 0.0,
            "pipeline_crosses_nodes": False, "samples_per_step": 8}
    return StepWork(**{**base, **changes})  # type: ignore[arg-type]


def test_compute_is_six_n_t_split_over_the_ranks_that_share_it_and_eight_with_checkpointing():
    assert step_time(_work(), DEVICE)["terms"]["compute"] == pytest.approx(6 * 1e9 * 1000 / 1e12)
    assert step_time(_work(activation_checkpointing=True), DEVICE)["terms"]["compute"] == pytest.approx(8.0)
    # a pipeline stage computes its half of the layers; a tensor-parallel group without prescaled_batch joins its
    # ranks' batches (the same work per rank as alone), with it the group shares one batch
    assert step_time(_work(pipeline_stages=2, microbatches=4), DEVICE)["terms"]["compute"] == pytest.approx(3.0)
    assert step_time(_work(tensor_parallel=2), DEVICE)["terms"]["compute"] == pytest.approx(6.0)
    assert step_time(_work(tensor_parallel=2, prescaled_batch=True), DEVICE)["terms"]["compute"] == pytest.approx(3.0)


def test_the_bubble_is_p_minus_one_over_m_of_the_compute_and_each_message_costs_its_latency():
    piped = step_time(_work(pipeline_stages=4, microbatches=8, pipeline_send_bytes=1e9, pipeline_messages=16,
                            samples_per_step=2), DEVICE)
    assert piped["terms"]["pipeline bubble"] == pytest.approx(piped["terms"]["compute"] * 3 / 8)
    assert piped["terms"]["pipeline sends"] == pytest.approx(1e9 / 1e9 + 16 * 1e-5)
    across = step_time(_work(data_parallel_cross_node_bytes=1e8, data_parallel_cross_node_messages=10), DEVICE)
    assert across["terms"]["data-parallel traffic"] == pytest.approx(1.0 + 10 * 2e-5)
    assert across["seconds"] == pytest.approx(sum(across["terms"].values()))
    assert across["seconds_per_sample"] == pytest.approx(across["seconds"] / 8)
    assert piped["decided_by"] == "compute" and across["decided_by"] == "compute"


def test_pipeline_sends_are_activations_forward_and_gradients_back():
    assert pipeline_send_bytes(stages=1, batch_per_rank=8, seq_len=16, hidden=4, bytes_per_element=2) == 0
    assert pipeline_send_bytes(stages=2, batch_per_rank=8, seq_len=16, hidden=4, bytes_per_element=2) == 2 * 8 * 16 * 4 * 2
