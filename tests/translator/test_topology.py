"""SMP rank arithmetic, checked exhaustively for every layout of up to 64 ranks."""

from itertools import product

import pytest

from smp2ds.translator.topology import PLACEMENT_ORDERS, Topology, placement_order

STRATEGIES = ("cluster", "spread", *PLACEMENT_ORDERS)
SIZE_OF = {"P": "pp", "T": "tp", "D": "rdp"}


def _layouts(max_world: int = 64):
    for world in range(1, max_world + 1):
        for pp in range(1, world + 1):
            if world % pp:
                continue
            for tp in range(1, world // pp + 1):
                if (world // pp) % tp == 0:
                    yield pp, tp, world // (pp * tp)


def _enumerated(topo: Topology) -> dict[int, dict[str, int]]:
    """Ranks by counting through the axes slowest-first: an independent statement of the rule."""
    letters = topo.order
    sizes = [getattr(topo, SIZE_OF[letter]) for letter in letters]
    return {
        rank: dict(zip(letters, digits))
        for rank, digits in enumerate(product(*(range(s) for s in sizes)))
    }


def test_aliases_and_letters():
    assert placement_order("cluster") == "DPT"
    assert placement_order("spread") == "TPD"
    assert set(PLACEMENT_ORDERS) == {"DPT", "DTP", "PDT", "PTD", "TDP", "TPD"}
    with pytest.raises(ValueError, match="placement_strategy 'DPP'"):
        placement_order("DPP")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_layout_up_to_64_ranks(strategy):
    checked = 0
    for pp, tp, rdp in _layouts():
        topo = Topology(pp=pp, tp=tp, rdp=rdp, placement=strategy)
        world = topo.world_size
        expected = _enumerated(topo)
        for rank in range(world):
            c = topo.coords(rank)
            assert (c.pp_rank, c.tp_rank, c.rdp_rank) == (
                expected[rank]["P"], expected[rank]["T"], expected[rank]["D"]
            )
            assert topo.rank_of(c.pp_rank, c.tp_rank, c.rdp_rank) == rank
        sizes = {"world": world, "pp": pp, "tp": tp, "rdp": rdp, "dp": tp * rdp, "mp": pp * tp}
        in_group_rank = {
            "pp": lambda c: c.pp_rank,
            "tp": lambda c: c.tp_rank,
            "rdp": lambda c: c.rdp_rank,
            "dp": lambda c: c.dp_rank,
            "mp": lambda c: c.mp_rank,
            "world": lambda c: c.rank,
        }
        for kind, size in sizes.items():
            groups = topo.groups(kind)
            assert sorted(r for g in groups for r in g) == list(range(world)), kind
            assert all(len(g) == size for g in groups), kind
            for group in groups:
                # The list position of each member is its rank inside the group.
                assert [in_group_rank[kind](topo.coords(r)) for r in group] == list(range(size)), kind
        # Members of a dp group share the stage; of an mp group share the replica.
        assert all(len({topo.coords(r).pp_rank for r in g}) == 1 for g in topo.groups("dp"))
        assert all(len({topo.coords(r).rdp_rank for r in g}) == 1 for g in topo.groups("mp"))
        assert topo.mp * rdp == pp * topo.dp == world
        checked += 1
    assert checked > 300


def test_documented_examples_eight_ranks():
    dpt = Topology(pp=2, tp=2, rdp=2, placement="DPT")
    ptd = Topology(pp=2, tp=2, rdp=2, placement="PTD")
    for r in range(8):
        c = dpt.coords(r)
        assert (c.rdp_rank, c.pp_rank, c.tp_rank) == (r // 4, (r // 2) % 2, r % 2)
        c = ptd.coords(r)
        assert (c.pp_rank, c.tp_rank, c.rdp_rank) == (r // 4, (r // 2) % 2, r % 2)
    spread = Topology(pp=2, rdp=4, placement="spread")
    cluster = Topology(pp=2, rdp=4, placement="cluster")
    assert spread.groups("mp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert spread.groups("dp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cluster.groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert cluster.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_dp_and_mp_rank_formulas_follow_letter_order():
    # T left of D: dp_rank = rdp_rank + rdp*tp_rank; otherwise tp_rank + tp*rdp_rank.
    tpd = Topology(pp=1, tp=2, rdp=3, placement="TPD")
    dpt = Topology(pp=1, tp=2, rdp=3, placement="DPT")
    for r in range(6):
        a, b = tpd.coords(r), dpt.coords(r)
        assert a.dp_rank == a.rdp_rank + 3 * a.tp_rank
        assert b.dp_rank == b.tp_rank + 2 * b.rdp_rank
    # T left of P: mp_rank = pp_rank + pp*tp_rank; otherwise tp_rank + tp*pp_rank.
    tdp = Topology(pp=3, tp=2, rdp=1, placement="TDP")
    pdt = Topology(pp=3, tp=2, rdp=1, placement="PDT")
    for r in range(6):
        a, b = tdp.coords(r), pdt.coords(r)
        assert a.mp_rank == a.pp_rank + 3 * a.tp_rank
        assert b.mp_rank == b.tp_rank + 2 * b.pp_rank


@pytest.mark.parametrize("world,pp,shard", [(8, 1, 2), (8, 1, 4), (16, 2, 4), (12, 1, 3), (4, 1, 4), (4, 1, 1)])
def test_shard_and_replica_groups(world, pp, shard):
    topo = Topology.for_world(world, pp=pp)
    shards, replicas = topo.shard_groups(shard), topo.replica_groups(shard)
    assert sorted(r for g in shards for r in g) == list(range(world))
    assert sorted(r for g in replicas for r in g) == list(range(world))
    for g in shards:
        dp_ranks = [topo.coords(r).dp_rank for r in g]
        assert len(g) == shard and dp_ranks == list(range(dp_ranks[0], dp_ranks[0] + shard))
        assert len({topo.coords(r).pp_rank for r in g}) == 1
    for g in replicas:
        assert len(g) == topo.dp // shard
        assert len({topo.coords(r).dp_rank % shard for r in g}) == 1
    # Every shard group meets every replica group of its stage in exactly one rank.
    for s in shards:
        for r in replicas:
            if topo.coords(s[0]).pp_rank == topo.coords(r[0]).pp_rank:
                assert len(set(s) & set(r)) == 1


def test_invalid_layouts_are_clear_errors():
    with pytest.raises(ValueError, match=r"world_size\(6\) is not divisible by .*= 4"):
        Topology.for_world(6, pp=2, tp=2)
    with pytest.raises(ValueError, match=r"sharded_data_parallel_degree\(3\) must divide the data-parallel degree\(4\)"):
        Topology.for_world(4).shard_groups(3)
    with pytest.raises(ValueError, match="pp must be an int >= 1"):
        Topology(pp=0)
