"""``smp2ds explain FILE --scale``: the chosen layout next to ZeRO-3 and plain data parallelism.

One row per layout with the per-rank model-state memory and the bytes each rank sends per
optimizer step, split by link: inside a node (NVLink / shared memory) and across nodes (the
network). Every figure comes from ``smp2ds.translator.tools.estimate`` (docs/internals.md#cost-model),
the same formulas the benches compare their measured traffic with; nothing is computed here
except the in-node share, which is each scheme's traffic minus its cross-node traffic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .report import human_bytes, human_count, table

ROWS: tuple[tuple[str, str], ...] = (
    ("zero3", "ZeRO-3 over all data-parallel ranks"),
    ("ddp", "plain data parallelism (DDP)"),
)


def scale_summary(estimate: Mapping[str, Any], topology: Mapping[str, Any]) -> dict[str, Any]:
    """The comparison as a JSON-ready dict: the layout, then one entry per compared scheme."""
    schemes = estimate["schemes"]
    selected = str(estimate["selected"])
    rows = [("selected", f"this plan ({selected})", selected)] + [(key, label, key) for key, label in ROWS]
    compared = {}
    for key, label, scheme_name in rows:
        scheme = schemes[scheme_name]
        cross = float(scheme["cross_node_bytes_per_rank"])
        compared[key] = {
            "scheme": scheme_name,
            "label": label,
            "memory_bytes_per_rank": float(scheme["memory_bytes_per_rank"]),
            "in_node_bytes_per_rank": float(scheme["bytes_per_rank"]) - cross,
            "cross_node_bytes_per_rank": cross,
            "bytes_per_rank": float(scheme["bytes_per_rank"]),
        }
    world = int(topology["world_size"])
    rpn = int(estimate["ranks_per_node"])
    return {
        "n_params": estimate["n_params"],
        "n_params_source": estimate.get("n_params_source"),
        "world_size": world,
        "ranks_per_node": rpn,
        "nodes": -(-world // rpn),
        "pipeline_parallel_degree": topology["pipeline_parallel_degree"],
        "tensor_parallel_degree": topology["tensor_parallel_degree"],
        "data_parallel_size": estimate["data_parallel_size"],
        "shard_size": estimate["shard_size"],
        "gradient_accumulation_steps": estimate["gradient_accumulation_steps"],
        "bytes_per_param_copy": estimate["bytes_per_param_copy"],
        "layouts": compared,
    }


def render_scale_text(summary: Mapping[str, Any], source: str) -> str:
    """The comparison table for people."""

    head = (
        f"{source}: {human_count(summary['n_params'])} parameters"
        + (" (default: pass --params)" if str(summary["n_params_source"]).startswith("default") else "")
        + f" on {summary['world_size']} ranks "
        f"({summary['nodes']} node(s) x {summary['ranks_per_node']}); pipeline {summary['pipeline_parallel_degree']}"
        f" x tensor {summary['tensor_parallel_degree']} x data-parallel {summary['data_parallel_size']}"
        + (f" (shard groups of {summary['shard_size']})" if summary["shard_size"] > 1 else "")
        + f"; {summary['gradient_accumulation_steps']} micro-batch(es) per step, "
        f"{summary['bytes_per_param_copy']}-byte parameter copies"
    )
    rows = [
        [
            row["label"],
            human_bytes(row["memory_bytes_per_rank"]),
            human_bytes(row["in_node_bytes_per_rank"]),
            human_bytes(row["cross_node_bytes_per_rank"]),
        ]
        for row in summary["layouts"].values()
    ]
    columns = ["layout", "model states/rank", "in-node bytes/rank/step", "cross-node bytes/rank/step"]
    notes = (
        "model states: Adam under DeepSpeed, 20 bytes per parameter in 16-bit DDP, 16 in fp32, 2w + 16 under ZeRO "
        "(w = parameter bytes), sharded as the layout says; activations excluded. Traffic: ring "
        "collectives of the data-parallel schemes per optimizer step; cross-node counts every collective whose "
        "group spans nodes. Formulas: smp2ds.translator.tools.estimate."
    )
    return f"{head}\n{table(columns, rows)}{notes}\n"
