"""``smp2ds explain --scale``: figures checked against values worked out by hand.

Notation: P parameters, c bytes per parameter copy (4 in fp32), M = P/(pp*tp) * c, a ring over
g ranks moves (g-1)/g * M per all-gather / reduce-scatter and twice that per all-reduce; Adam's
model states are 16 bytes per parameter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smp2ds.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOCS_EXAMPLE = ROOT / "examples" / "configs" / "docs_example_001.json"


def scale(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["explain", *argv, "--scale", "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def figures(summary: dict) -> dict[str, tuple[float, float, float]]:
    return {
        key: (row["memory_bytes_per_rank"], row["in_node_bytes_per_rank"], row["cross_node_bytes_per_rank"])
        for key, row in summary["layouts"].items()
    }


def test_sharded_data_parallel_on_two_nodes(tmp_path, capsys):
    # 1e6 fp32 parameters, 4 ranks on 2 nodes of 2, shard groups of 2 (one per node), 2 replicas.
    config = tmp_path / "sdp.json"
    config.write_text(json.dumps({"ddp": True, "sharded_data_parallel_degree": 2}))
    summary = scale([str(config), "--world-size", "4", "--gpus-per-node", "2", "--params", "1e6"], capsys)
    assert (summary["nodes"], summary["data_parallel_size"], summary["shard_size"]) == (2, 4, 2)
    assert summary["layouts"]["selected"]["scheme"] == "mics"
    assert figures(summary) == {
        # ZeRO-3 in fp32 keeps 24 bytes per parameter (4 + 4 parameter and gradient, 8 of moments, 8 of fp32
        # copy and gradients) over the shard group: 24e6 / 2; gathers fwd+bwd and reduce-scatter in the node:
        # 3 * 1/2 * 4e6; replica all-reduce of the 4e6/2 partition across nodes: 2 * 1/2 * 2e6
        "selected": (12e6, 6e6, 2e6),
        # 24e6 / 4; 3 * 3/4 * 4e6, the group of 4 spans both nodes
        "zero3": (6e6, 0.0, 9e6),
        # everything replicated; one all-reduce 2 * 3/4 * 4e6 across nodes
        "ddp": (16e6, 0.0, 6e6),
    }


def test_pipeline_layout_of_the_docs_example(capsys):
    # partitions 2 x ddp on 8 ranks of one node: rdp 4, 4 micro-batches, fp32, 1e9 parameters
    summary = scale([str(DOCS_EXAMPLE), "--params", "1e9"], capsys)
    assert (summary["pipeline_parallel_degree"], summary["data_parallel_size"]) == (2, 4)
    assert summary["gradient_accumulation_steps"] == 4
    slice_bytes = 1e9 / 2 * 4  # M = 2e9
    assert figures(summary) == {
        "selected": (8e9, 2 * 3 / 4 * slice_bytes, 0.0),  # the plan is DDP across the rdp group
        # fp32 ZeRO-3: 24 bytes per parameter over 4; 3 collectives per micro-batch, 4 micro-batches
        "zero3": (3e9, 3 * 4 * 3 / 4 * slice_bytes, 0.0),
        "ddp": (8e9, 2 * 3 / 4 * slice_bytes, 0.0),
    }


def test_text_table(capsys):
    assert main(["explain", str(DOCS_EXAMPLE), "--scale"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"{DOCS_EXAMPLE}: 1B parameters (default: pass --params) on 8 ranks (1 node(s) x 8)")
    assert lines[1].split("  ")[0] == "layout" and "cross-node bytes/rank/step" in lines[1]
    # 8e9 bytes = 7.45 GiB of model states; 3e9 bytes = 2.79 GiB all-reduce (and ZeRO-3's states); 18e9 = 16.76 GiB
    assert lines[3].split() == ["this", "plan", "(ddp)", "7.45", "GiB", "2.79", "GiB", "0", "B"]
    assert lines[4].split()[-6:] == ["2.79", "GiB", "16.76", "GiB", "0", "B"]
