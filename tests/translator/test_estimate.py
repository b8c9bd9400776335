"""estimate(): the formulas of docs/internals.md#cost-model, worked by hand for concrete layouts."""

from __future__ import annotations

import pytest

from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan
from smp2ds.translator.tools.estimate import estimate

PSI = 1e9


def make(params, world, gpus, batch=None):
    layout = Layout(world_size=world, gpus_per_node=gpus, batch_size=batch)
    return plan(normalize(params, layout), layout)


def hop(scheme, prefix):
    (found,) = [h for h in scheme["hops"] if h["name"].startswith(prefix)]
    return found


def test_mics_one_node_per_shard_group_on_two_nodes():
    # 16 ranks = 2 nodes x 8, S = 8 (one node), R = 2, fp16 (M = 2 bytes x Psi), 2 micro-batches
    est = estimate(
        make({"ddp": True, "fp16": True, "sharded_data_parallel_degree": 8, "microbatches": 2}, 16, 8), PSI
    )
    m, s = 2 * PSI, 2
    mics, zero3 = est["schemes"]["mics"], est["schemes"]["zero3"]
    assert est["selected"] == "mics"
    assert mics["bytes_per_rank"] == pytest.approx(3 * s * 7 / 8 * m + 2 * (1 / 2) * m / 8)
    # only the replica all-reduce leaves the node: the design's 2(R-1)/R x M/S
    assert mics["cross_node_bytes_per_rank"] == pytest.approx(2 * (1 / 2) * m / 8)
    assert zero3["bytes_per_rank"] == pytest.approx(3 * s * 15 / 16 * m)
    assert zero3["cross_node_bytes_per_rank"] == zero3["bytes_per_rank"]
    # 16-bit: 2 + 2 bytes of parameter and gradient, 8 of Adam moments, 8 of fp32 master and gradients
    assert mics["memory_bytes_per_rank"] == pytest.approx(20 * PSI / 8)
    assert zero3["memory_bytes_per_rank"] == pytest.approx(20 * PSI / 16)
    assert est["schemes"]["ddp"]["memory_bytes_per_rank"] == pytest.approx(20 * PSI)
    assert est["schemes"]["ddp"]["bytes_per_rank"] == pytest.approx(2 * 15 / 16 * m)
    # ZeRO-1: fp16 params + grads whole (4 bytes/param), fp32 Adam state sharded over 16
    assert est["schemes"]["zero1"]["memory_bytes_per_rank"] == pytest.approx(4 * PSI + 16 * PSI / 16)
    assert mics["memory_fraction"] == pytest.approx(1 / 8)


def test_hierarchical_allgather_over_two_nodes_matches_the_1_875x_example():
    # docs/internals.md#cost-model: k=2 nodes of n=8, one shard group of p=16: 0.94 M vs 0.50 M per node
    est = estimate(make({"ddp": True, "bf16": True, "sharded_data_parallel_degree": 16}, 16, 8), PSI)
    mics = est["schemes"]["mics"]
    assert mics["hierarchical_allgather"] and mics["nodes_per_shard_group"] == 2
    m = 2 * PSI
    inter = hop(mics, "parameter all-gather (forward), inter-node")
    intra = hop(mics, "parameter all-gather (forward), intra-node")
    assert inter["bytes_per_rank"] == pytest.approx(m / 16) and inter["spans_nodes"]
    assert intra["bytes_per_rank"] == pytest.approx(7 / 8 * m) and not intra["spans_nodes"]
    per_node_hierarchical = 8 * inter["bytes_per_rank"]
    flat_ring = 15 / 16 * m
    assert per_node_hierarchical == pytest.approx(0.5 * m)
    assert flat_ring / per_node_hierarchical == pytest.approx(1.875)
    assert hop(mics, "replica all-reduce")["bytes_per_rank"] == 0  # R = 1


def test_flat_allgather_when_hierarchy_is_off():
    est = estimate(
        make({"ddp": True, "sharded_data_parallel_degree": 16, "sdp_hierarchical_allgather": False}, 16, 8),
        PSI,
    )
    mics = est["schemes"]["mics"]
    assert not mics["hierarchical_allgather"]
    m = 4 * PSI  # fp32
    assert hop(mics, "parameter all-gather (forward)")["bytes_per_rank"] == pytest.approx(15 / 16 * m)


def test_model_parallelism_divides_the_model_states():
    est = estimate(
        make(
            {"partitions": 2, "tensor_parallel_degree": 2, "ddp": True, "shard_optimizer_state": True}, 8, 8
        ),
        PSI,
    )
    assert est["model_states_bytes_unsharded"] == pytest.approx(16 * PSI / 4)
    assert est["selected"] == "zero1" and est["data_parallel_size"] == 2
    assert est["schemes"]["ddp"]["cross_node_bytes_per_rank"] == 0  # all 8 ranks on one node


def test_estimate_accepts_a_config_and_layout():
    layout = Layout(world_size=4, gpus_per_node=2)
    cfg = normalize({"ddp": True, "sharded_data_parallel_degree": 2}, layout)
    est = estimate(cfg, 3e9, layout=layout)
    assert est["schemes"]["mics"]["replicas"] == 2 and est["n_params"] == 3e9


def test_rejects_non_positive_parameter_counts():
    with pytest.raises(ValueError, match="n_params"):
        estimate(make({}, 1, 1), 0)
