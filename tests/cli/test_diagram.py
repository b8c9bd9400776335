"""``smp2ds explain --diagram / --schedule``: the drawn data equals the plan and the engine's schedule.

* the rank grid (nodes, each rank's labels, the groups coloured per kind) is compared with
  ``plan.topology`` as the planner emits it (its group lists, whose in-group order is the rank
  along that axis);
* each stage's passes in the timeline are compared with the commands of the schedule objects the
  engine hands DeepSpeed's pipeline engine (``smp2ds.engine.pipeline.schedules``), micro-batch
  by micro-batch; the timeline's bubble with the textbook (p - 1) / (m + p - 1);
* the command writes real PNG and SVG files, and without matplotlib says how to install it (exit 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan
from smp2ds.translator.tools.diagram import rank_grid, schedule_timeline, stage_order

ROOT = Path(__file__).resolve().parents[2]

LAYOUTS = [
    ({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True}, 4, 4),
    ({"sharded_data_parallel_degree": 4, "ddp": True, "prescaled_batch": True}, 16, 8),
    ({"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True,
      "placement_strategy": "spread"}, 16, 8),
    ({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "placement_strategy": "TPD",
      "microbatches": 2}, 16, 4),
]


def planned(params: dict, world: int, per_node: int):
    layout = Layout(world_size=world, gpus_per_node=per_node)
    return plan(normalize(params, layout), layout)


@pytest.mark.parametrize(("params", "world", "per_node"), LAYOUTS)
def test_grid_equals_plan_topology(params, world, per_node):
    topo = planned(params, world, per_node).topology
    grid = rank_grid(topo)
    assert [c.rank for c in grid.cells] == list(range(topo["world_size"]))
    assert len(grid.nodes) == topo["nodes"] and sum(grid.nodes, []) == list(range(world))
    for n, ranks in enumerate(grid.nodes):
        assert all(grid.cells[r].node == n for r in ranks) and len(ranks) == topo["ranks_per_node"]
    # Labels: a rank's position in its group of a kind is its rank along that axis.
    for kind, attr in (("pp", "pp_rank"), ("tp", "tp_rank"), ("rdp", "rdp_rank")):
        for group in topo["groups"][kind]:
            assert [getattr(grid.cells[r], attr) for r in group] == list(range(len(group)))
    # Groups drawn per kind: the plan's, leaving out kinds whose every group is one rank.
    drawn = {k: g for k, g in topo["groups"].items() if k in ("pp", "tp", "rdp") and max(map(len, g)) > 1}
    if topo["sharded_data_parallel_degree"] > 1:
        drawn.pop("rdp")
        drawn.update(shard=topo["shard_groups"], replica=topo["replica_groups"])
        for i, group in enumerate(topo["shard_groups"]):
            assert {grid.cells[r].shard_group for r in group} == {i}
            assert all(f"sdp{i}" in grid.cells[r].label for r in group)
    else:
        assert all(c.shard_group is None for c in grid.cells)
    assert grid.groups == drawn


def _engine_passes(kind: str, m: int, pp: int, stage: int, group: int) -> list[tuple[str, int]]:
    """(phase, micro-batch) of every compute command of the engine's schedule for ``stage``."""
    from deepspeed.runtime.pipe import schedule as ds

    from smp2ds.engine.pipeline.schedules import make_train_schedule

    sched = make_train_schedule(kind, m, pp, stage, group)
    out = []
    if kind == "1f1b":  # DeepSpeed's TrainSchedule keys each step to a micro-batch itself
        for step, cmds in enumerate(sched.steps()):
            mb, _ = sched._step_to_micro_batch(step)
            out += [("F" if isinstance(c, ds.ForwardPass) else "B", mb) for c in cmds
                    if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]
        return out
    # GPipe issues micro-batches in order; buffers are reused per group, so recover mb from the order
    seen = {"F": 0, "B": 0}
    for cmds in sched.steps():
        for c in cmds:
            if isinstance(c, (ds.ForwardPass, ds.BackwardPass)):
                phase = "F" if isinstance(c, ds.ForwardPass) else "B"
                assert c.buffer_id == seen[phase] % sched.num_pipe_buffers()
                out.append((phase, seen[phase]))
                seen[phase] += 1
    return out


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 2), (4, 7), (2, 1)])
def test_stage_order_is_the_engines(kind, pp, m):
    for group in ((m,) if kind == "1f1b" else (1, 2, m)):
        for stage in range(pp):
            assert stage_order(kind, m, pp, stage, group) == _engine_passes(kind, m, pp, stage, group)


@pytest.mark.parametrize("pipeline", ["interleaved", "simple"])
@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (3, 3)])
def test_timeline_respects_dependencies_and_has_the_textbook_bubble(pipeline, pp, m):
    result = planned({"pipeline_parallel_degree": pp, "microbatches": m, "active_microbatches": m,
                      "pipeline": pipeline, "ddp": True},
                     pp, pp)
    tl = schedule_timeline(result.engine["pipeline"])
    assert tl.kind == ("gpipe" if pipeline == "simple" else "1f1b")
    at = {(p.stage, p.phase, p.microbatch): p for p in tl.passes}
    assert len(at) == 2 * pp * m
    for (s, phase, mb), p in at.items():
        before = at.get((s - 1, "F", mb)) if phase == "F" else at.get((s + 1, "B", mb), at[(s, "F", mb)])
        assert before is None or before.end <= p.start
    for s in range(pp):  # one pass at a time per stage
        row = [p for p in tl.passes if p.stage == s]
        assert all(a.end <= b.start for a, b in zip(row, row[1:]))
    # Uniform passes: both schedules idle (p - 1) pass slots of m + p - 1 on each stage.
    assert tl.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert tl.makespan == pytest.approx(3 * (m + pp - 1))


def explain(*argv: str, block_matplotlib: bool = False) -> subprocess.CompletedProcess:
    # sys.modules[name] = None is Python's documented way to make `import name` fail.
    code = ("import sys\n" + ("sys.modules['matplotlib'] = None\n" if block_matplotlib else "")
            + "from smp2ds.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, "explain", *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_cli_writes_png_and_svg(tmp_path):
    pytest.importorskip("matplotlib")
    config = tmp_path / "smp.json"
    config.write_text(json.dumps({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True,
                                  "microbatches": 4}))
    grid, sched = tmp_path / "grid.png", tmp_path / "sched.svg"
    proc = explain(str(config), "--world-size", "4", "--diagram", str(grid), "--schedule", str(sched),
                   "--format", "json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["topology"]["world_size"] == 4  # stdout stays the report
    assert grid.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in sched.read_bytes()[:2000]
    assert f"wrote the rank grid to {grid}" in proc.stderr


def test_cli_refusals(tmp_path):
    config = tmp_path / "smp.json"
    config.write_text(json.dumps({"ddp": True}))
    proc = explain(str(config), "--world-size", "4", "--diagram", str(tmp_path / "x.png"), block_matplotlib=True)
    assert proc.returncode == 2 and "pip install 'smp2ds[plot]'" in proc.stderr
    assert not (tmp_path / "x.png").exists()
    proc = explain(str(config), "--world-size", "4", "--schedule", str(tmp_path / "s.png"))
    assert proc.returncode == 2 and "pipeline_parallel_degree is 1" in proc.stderr
    proc = explain(str(config), "--world-size", "4", "--diagram", str(tmp_path / "x.pdf"))
    assert proc.returncode == 2 and ".svg or .png" in proc.stderr



def test_a_large_layout_is_drawn_condensed_with_every_group_kept(tmp_path):
    """The 4-node estimator a new user drew (tp 8, spread) is small enough; 256 ranks on 32 nodes of 8 used to be
    refused. Now the first two nodes and the last are drawn, their cells labelled as in the full grid, and every
    group of the plan kept (so more than 10 groups stay numbered apart)."""
    topo = planned({"tensor_parallel_degree": 8, "ddp": True, "placement_strategy": "spread"}, 256, 8).topology
    grid = rank_grid(topo)
    assert grid.node_ids == [0, 1, 31] and grid.elided_nodes == 29
    assert [c.rank for c in grid.cells] == [*range(16), *range(248, 256)]
    assert "drawn: nodes 0, 1, 31" in grid.title
    assert len(grid.groups["tp"]) == 32 and sum(map(len, grid.groups["tp"])) == 256
    cell = grid.cell(250)
    assert (cell.node, cell.local_rank, cell.tp_rank) == (31, 2, topo_coords(topo, 250).tp_rank)
    pytest.importorskip("matplotlib")
    config = tmp_path / "smp.json"
    config.write_text(json.dumps({"tensor_parallel_degree": 8, "ddp": True, "placement_strategy": "spread"}))
    out = tmp_path / "grid.svg"
    proc = explain(str(config), "--world-size", "256", "--gpus-per-node", "8", "--diagram", str(out))
    assert proc.returncode == 0, proc.stderr
    svg = out.read_text()
    assert "29 nodes like it not drawn" in svg and "g31" in svg


def topo_coords(topo: dict, rank: int):
    from smp2ds.translator.topology import Topology

    return Topology(pp=topo["pipeline_parallel_degree"], tp=topo["tensor_parallel_degree"], rdp=topo["rdp_degree"],
                    placement=topo["placement"]).coords(rank)
