"""Pure MiCS layout rules, the hierarchical re-layout and the counter's arithmetic (no processes)."""

from __future__ import annotations

import re

import pytest

from smp2ds.engine.mics.rank_arithmetic import MicsLayout, plan_hierarchical
from smp2ds.translator.topology import Topology


@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16, 32, 64])
def test_shard_and_replica_groups_tile_the_ranks(world):
    for shard in [s for s in range(1, world + 1) if world % s == 0]:
        for rank in range(world):
            layout = MicsLayout.build(Topology(rdp=world), shard, rank)
            assert layout.replicas * shard == world
            # Shard groups: consecutive blocks; replica groups: one member per shard group, same position.
            assert layout.shard_groups == tuple(tuple(range(i, i + shard)) for i in range(0, world, shard))
            assert sorted(r for g in layout.replica_groups for r in g) == list(range(world))
            assert layout.shard_ranks[layout.replica_index] == rank
            assert layout.replica_ranks[layout.shard_index] == rank
            assert all(len({layout.shard_groups.index(next(g for g in layout.shard_groups if r in g))
                            for r in rep}) == len(rep) for rep in layout.replica_groups)


@pytest.mark.parametrize("shard, given", [(3, 3), (0, 0), (8, 8), ("2", "2")])
def test_invalid_shard_size_names_the_value_and_the_allowed_ones(shard, given):
    pattern = re.escape(f"sharded_data_parallel_degree({given!r})") + r".*allowed: \[1, 2, 4\]"
    with pytest.raises(ValueError, match=pattern):
        MicsLayout.build(Topology(rdp=4), shard, 0)


def test_pipeline_with_mics_is_a_clear_error_and_tensor_parallel_shards_inside_rdp():
    with pytest.raises(ValueError, match=r"pp=2"):
        MicsLayout.build(Topology(pp=2, rdp=2), 2, 0)
    # tp 2 x rdp 4 (cluster: tp fastest): shard groups of 2 inside each rdp group, i.e. among the ranks
    # holding the same tensor-parallel shard; positions inside shard and replica groups at any tp.
    topo = Topology(tp=2, rdp=4)
    layout = MicsLayout.build(topo, 2, 5)
    assert layout.shard_groups == ((0, 2), (4, 6), (1, 3), (5, 7))
    assert layout.replica_groups == ((0, 4), (2, 6), (1, 5), (3, 7))
    assert (layout.shard_ranks, layout.shard_rank, layout.replica_ranks, layout.replica_rank) == ((5, 7), 0, (1, 5), 1)
    assert layout.replicas == 2
    with pytest.raises(ValueError, match=r"1..rdp\(4\) that divides rdp"):
        MicsLayout.build(topo, 8, 0)


@pytest.mark.parametrize("per_node, nodes", [(1, 2), (2, 2), (2, 4), (4, 2), (8, 2), (8, 4)])
def test_hierarchical_plan_splits_a_multi_node_group(per_node, nodes):
    group = tuple(range(16, 16 + per_node * nodes))  # starts on a node boundary, not at rank 0
    plan = plan_hierarchical(group, per_node)
    assert plan.enabled and plan.nodes == nodes and plan.per_node == per_node
    assert plan.intra_groups == tuple(group[j * per_node:(j + 1) * per_node] for j in range(nodes))
    for pos, inter in enumerate(plan.inter_groups):
        assert inter == tuple(group[j * per_node + pos] for j in range(nodes))
        assert len({r // per_node for r in inter}) == nodes  # one rank per node


def test_hierarchical_is_off_with_a_reason_when_it_cannot_or_need_not_apply():
    assert "fits in one node" in plan_hierarchical((0, 1), 2).reason
    assert "fits in one node" in plan_hierarchical((4, 5, 6, 7), 8).reason
    assert "unknown" in plan_hierarchical((0, 1, 2, 3), None).reason
    uneven = plan_hierarchical(tuple(range(12)), 8)  # 8 ranks on node 0, 4 on node 1
    assert not uneven.enabled and "evenly" in uneven.reason
    layout = MicsLayout.build(Topology(rdp=8), 4, 0, ranks_per_node=2, hierarchical=False)
    assert not layout.my_hierarchical.enabled and "false" in layout.my_hierarchical.reason


@pytest.mark.parametrize("nodes, per_node, part", [(2, 2, 5), (2, 4, 3), (4, 2, 1), (3, 3, 7)])
def test_two_stage_relayout_reproduces_the_flat_allgather_order(nodes, per_node, part):
    import torch

    from smp2ds.engine.mics.allgather import _HierarchicalHandle

    parts = [torch.arange(part, dtype=torch.float64) + 100 * g for g in range(nodes * per_node)]
    # Stage 1 on rank at position l gathers P_{j*n+l} over nodes j; stage 2 gathers those over l.
    inter = [torch.cat([parts[j * per_node + pos] for j in range(nodes)]) for pos in range(per_node)]
    gathered = torch.cat(inter)
    out = torch.empty(nodes * per_node * part, dtype=torch.float64)
    _HierarchicalHandle(None, gathered, out, nodes, per_node).wait()
    assert torch.equal(out, torch.cat(parts))


def test_counter_ring_model_and_node_spans():
    from smp2ds.engine.diagnostics.comm_counter import CommRecord

    ar = CommRecord("all_reduce", (0, 2), 1000)
    ag = CommRecord("all_gather_into_tensor", (0, 1, 2, 3), 1000)
    assert ar.ring_bytes == 1000.0 and ag.ring_bytes == 750.0
    assert ar.spans_nodes(2) and not CommRecord("all_reduce", (0, 1), 8).spans_nodes(2)
    assert CommRecord("broadcast", (3,), 64).ring_bytes == 0.0


def test_counter_patches_only_while_installed():
    import torch.distributed as dist

    from smp2ds.engine.diagnostics.comm_counter import CommCounter

    before = dist.all_reduce, dist.all_gather_into_tensor, dist.reduce_scatter_tensor
    with CommCounter():
        assert dist.all_reduce is not before[0] and getattr(dist.all_reduce, "_smp2ds_counted", False)
    assert (dist.all_reduce, dist.all_gather_into_tensor, dist.reduce_scatter_tensor) == before
