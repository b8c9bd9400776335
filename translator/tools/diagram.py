"""What ``smp2ds explain --diagram`` and ``--schedule`` draw, as data (pure; no plotting library).

Two pictures, each computed here and only rendered by ``smp2ds.cli.diagram``:

* `rank_grid`: the nodes of a layout, the ranks inside each node with their pipeline stage,
  tensor-parallel rank, reduced-data-parallel rank and sharded-data-parallel shard group, and
  the groups that communicate, per kind. It is read from ``plan.topology`` (the same placement
  arithmetic the engine uses to create its process groups), never recomputed by other rules.
* `schedule_timeline`: forward and backward passes per micro-batch and stage over time for the
  schedule the planner chose (``plan.engine["pipeline"]["schedule_choice"]``). Each stage runs
  its passes in the order of the engine's schedule (`stage_order`; a test checks it against
  ``smp2ds.engine.pipeline.schedules``); a pass starts when its stage is free and its input has
  arrived, so idle time (the bubble) falls out of the dependencies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..topology import Topology

MAX_DRAWN_RANKS = 128
"""Above this many ranks a grid of labelled boxes is no longer readable: a larger layout is drawn condensed, its
first two nodes and its last one standing for the rest (the placement repeats node after node)."""

Phase = Literal["F", "B"]


@dataclass(frozen=True)
class RankCell:
    """One rank as drawn: where it sits and what it is labelled with."""

    rank: int
    node: int
    local_rank: int
    pp_rank: int
    tp_rank: int
    rdp_rank: int
    shard_group: int | None
    """Index into ``RankGrid.groups["shard"]`` (None without sharded data parallelism)."""

    @property
    def label(self) -> str:
        text = f"r{self.rank}\npp{self.pp_rank} tp{self.tp_rank}\nrdp{self.rdp_rank}"
        return text + ("" if self.shard_group is None else f" sdp{self.shard_group}")


@dataclass(frozen=True)
class RankGrid:
    """The drawn nodes (each the list of its global ranks), their labelled ranks and the groups per kind."""

    nodes: list[list[int]]
    cells: list[RankCell]
    """The drawn ranks, in rank order (every rank unless the layout is condensed)."""
    groups: dict[str, list[list[int]]]
    """Kind -> every group of the layout, each in in-group rank order (drawn: the members on drawn nodes);
    only kinds with a group of more than one rank."""
    title: str
    node_ids: list[int] = field(default_factory=list)
    """The layout's index of each drawn node (``0..N-1`` unless condensed)."""
    elided_nodes: int = 0
    """Nodes not drawn (condensed layouts), between the second drawn node and the last."""

    def cell(self, rank: int) -> RankCell:
        """The drawn cell of ``rank``."""
        return self._by_rank[rank]

    @property
    def _by_rank(self) -> dict[int, RankCell]:
        return {c.rank: c for c in self.cells}


def rank_grid(topology: Mapping[str, Any]) -> RankGrid:
    """The grid of ``plan.topology`` (a Plan's ``topology`` section), ready to render.

    Above `MAX_DRAWN_RANKS` ranks only representative nodes are drawn (:func:`shown_nodes`).
    """
    world = int(topology["world_size"])
    topo = Topology(pp=int(topology["pipeline_parallel_degree"]), tp=int(topology["tensor_parallel_degree"]),
                    rdp=int(topology["rdp_degree"]), placement=str(topology["placement"]))
    per_node = int(topology["ranks_per_node"])
    shard = int(topology.get("sharded_data_parallel_degree", 1) or 1)
    groups = {kind: topo.groups(kind) for kind in ("pp", "tp", "rdp")}
    if shard > 1:
        # With MiCS the rdp group splits into shard groups (parameters gathered inside) and
        # replica groups (gradients all-reduced across): those are what communicate.
        del groups["rdp"]
        groups["shard"] = topo.shard_groups(shard)
        groups["replica"] = topo.replica_groups(shard)
    shard_of = {r: i for i, g in enumerate(groups.get("shard", [])) for r in g}
    all_nodes = [list(range(n * per_node, min(world, (n + 1) * per_node))) for n in range(-(-world // per_node))]
    node_ids = shown_nodes(len(all_nodes), per_node)
    nodes = [all_nodes[n][:MAX_DRAWN_RANKS] for n in node_ids]
    cells = []
    for rank in (r for ranks in nodes for r in ranks):
        c = topo.coords(rank)
        cells.append(RankCell(rank=rank, node=rank // per_node, local_rank=rank % per_node, pp_rank=c.pp_rank,
                              tp_rank=c.tp_rank, rdp_rank=c.rdp_rank, shard_group=shard_of.get(rank)))
    title = (f"{world} ranks on {len(all_nodes)} node(s) of {per_node}: pp={topo.pp} tp={topo.tp} rdp={topo.rdp}"
             + (f" sdp={shard}" if shard > 1 else "") + f", placement {topo.order}")
    if len(cells) < world:
        title += f"; drawn: nodes {', '.join(map(str, node_ids))} (the others repeat the pattern)"
    return RankGrid(nodes=nodes, cells=cells, groups={k: g for k, g in groups.items() if max(map(len, g)) > 1},
                    title=title, node_ids=node_ids, elided_nodes=len(all_nodes) - len(node_ids))


def shown_nodes(count: int, per_node: int) -> list[int]:
    """The nodes drawn of ``count`` nodes of ``per_node`` ranks: all of them up to `MAX_DRAWN_RANKS` ranks, else
    the first two and the last (a node of more ranks than that is drawn alone, cut to its first ranks)."""
    if count * per_node <= MAX_DRAWN_RANKS:
        return list(range(count))
    if 3 * per_node > MAX_DRAWN_RANKS or count < 3:
        return [0]
    return [0, 1, count - 1]


@dataclass(frozen=True)
class Pass:
    """One forward (``F``) or backward (``B``) pass of a micro-batch on a stage, over [start, end)."""

    stage: int
    microbatch: int
    phase: Phase
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every pass of one training step, the step's length and the idle share of stage time."""

    kind: str
    stages: int
    microbatches: int
    group_size: int
    passes: list[Pass]
    makespan: float
    bubble_fraction: float
    note: str


def stage_order(kind: str, microbatches: int, stages: int, stage: int, group_size: int) -> list[tuple[Phase, int]]:
    """The passes stage ``stage`` runs, in order, under the engine's schedule ``kind``.

    ``gpipe``: the forwards of a group of ``group_size`` micro-batches, then their backwards.
    ``1f1b`` (DeepSpeed's ``TrainSchedule``): ``stages - stage - 1`` warm-up forwards, then one
    forward and one backward alternately, then the remaining backwards.
    """
    if kind == "gpipe":
        out: list[tuple[Phase, int]] = []
        for start in range(0, microbatches, group_size):
            group = range(start, min(start + group_size, microbatches))
            out += [("F", m) for m in group] + [("B", m) for m in group]
        return out
    if kind != "1f1b":
        raise ValueError(f"unknown pipeline schedule kind {kind!r}; expected '1f1b' or 'gpipe'")
    warm = min(stages - stage - 1, microbatches)
    out = [("F", m) for m in range(warm)]
    for m in range(warm, microbatches):
        out += [("F", m), ("B", m - warm)]
    return out + [("B", m) for m in range(microbatches - warm, microbatches)]


def schedule_timeline(pipeline: Mapping[str, Any], forward: float = 1.0, backward: float = 2.0) -> Timeline:
    """The timeline of ``plan.engine["pipeline"]``: passes placed by their dependencies.

    A forward on stage s needs that micro-batch's forward on s-1; a backward needs its backward
    on s+1 (on the last stage, its own forward). ``backward`` = 2 x ``forward`` is the usual
    cost ratio (a backward computes gradients of inputs and of weights); communication is not drawn.
    """
    stages, micro = int(pipeline["stages"]), int(pipeline["microbatches"])
    choice = pipeline["schedule_choice"]
    orders = [stage_order(choice["kind"], micro, stages, s, int(choice["group_size"])) for s in range(stages)]
    done: dict[tuple[int, Phase, int], float] = {}
    free = [0.0] * stages
    cursor = [0] * stages
    passes: list[Pass] = []
    while any(cursor[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            if cursor[s] == len(orders[s]):
                continue
            phase, m = orders[s][cursor[s]]
            need = (s - 1, "F", m) if phase == "F" else ((s + 1, "B", m) if s + 1 < stages else (s, "F", m))
            if phase == "F" and s == 0:
                ready = 0.0
            elif need in done:
                ready = done[need]
            else:
                continue
            start = max(free[s], ready)
            end = start + (forward if phase == "F" else backward)
            passes.append(Pass(stage=s, microbatch=m, phase=phase, start=start, end=end))
            done[(s, phase, m)] = free[s] = end
            cursor[s] += 1
            progressed = True
        if not progressed:  # an order that waits on itself: a bug in stage_order, not a user error
            raise RuntimeError(f"pipeline schedule {choice['kind']} deadlocks at {cursor}")
    makespan = max(p.end for p in passes)
    busy = sum(p.end - p.start for p in passes)
    return Timeline(kind=choice["kind"], stages=stages, microbatches=micro, group_size=int(choice["group_size"]),
                    passes=sorted(passes, key=lambda p: (p.stage, p.start)), makespan=makespan,
                    bubble_fraction=1 - busy / (stages * makespan), note=str(choice["note"]))
