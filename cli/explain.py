"""``smp2ds explain FILE``: what happens to every key, and what the layout costs per rank.

Prints the key-fate table (key, value, fate, target pointer or reason), the plan's topology, the
engine backend the planner chose (the one ``smp.DistributedModel`` builds) and remarks, for
configurations that set ``tensor_parallel_degree`` the fate of each distributed-transformer
setting scripts pass to ``smp.model_creation`` (``translator/transformer_options.py``), then the
per-rank model-state memory and the communication volume per optimizer step computed by
``smp2ds.translator.tools.estimate.estimate`` for ``--params`` parameters.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from smp2ds.translator import transformer_options
from smp2ds.translator.load import load_document
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout, Plan, SMPConfig
from smp2ds.translator.planner import plan
from smp2ds.translator.smp2ds_settings import given_settings
from smp2ds.translator.tools import diagram as data
from smp2ds.translator.tools.estimate import estimate
from smp2ds.translator.tools.tp_traffic import tensor_parallel_traffic

from . import (
    EXIT_OK,
    UsageError,
    add_file_arg,
    add_format_arg,
    add_layout_args,
    command_parser,
    diagram,
    layout_from_args,
    memory,
    positive_int,
    report,
    scale,
    source_name,
    write_stdout,
)
from .diagram import output_path

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")


def parameter_count(text: str) -> int:
    """argparse type for ``--params``: ``30e9``, ``30B``, ``1.3b``, ``350M``, ``7000000``."""
    match = _COUNT.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"expected a parameter count such as 30e9, 30B or 350M, got {text!r}"
        )
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if not 1 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"parameter count must be >= 1, got {text!r}")
    return round(value)


def explain_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``explain`` (or build a standalone parser when ``subparsers`` is None)."""
    description = (
        "Show each key's fate (mapped, engine, ignored, unsupported) and the per-rank model-state "
        "memory and communication volume per step of the layout."
    )
    parser = command_parser(subparsers, "explain", description)
    add_file_arg(parser)
    parser.add_argument(
        "--params",
        type=parameter_count,
        metavar="COUNT",
        help="model parameters for the memory/communication estimate (30e9, 30B, 350M)",
    )
    parser.add_argument(
        "--model",
        metavar="CONFIG_JSON",
        help="a Hugging Face model config.json (model_type, architectures): show the pipeline split "
        "DistributedModel would choose, and use its parameter count when --params is not given "
        "(imports torch and transformers; the model is built on the meta device, without weights)",
    )
    parser.add_argument(
        "--scale",
        action="store_true",
        help="only compare this layout with ZeRO-3 and plain data parallelism: model-state memory per rank "
        "and bytes per rank and step over in-node and cross-node links",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        metavar="S",
        help="sequence length for the tensor-parallel traffic estimate (with --model and --batch-size; "
        "default: the model's maximum positions)",
    )
    memory.add_memory_args(parser)
    _add_drawing_args(parser)
    add_layout_args(parser)
    add_format_arg(parser)
    parser.set_defaults(handler=explain_command)
    return parser


def explain_command(args: argparse.Namespace) -> int:
    """Run ``explain``; returns 0, or raises for the guard in ``cli.run_guarded`` to report."""

    layout = layout_from_args(args)
    config = normalize(load_document(args.file), layout)
    result = plan(config, layout)
    if memory.wants_memory(args):
        return _memory(args, config, result, layout)
    split = _model_split(args.model, config) if args.model else None
    params = args.params or (split.n_params if split else None)
    estimate = _estimate(result, params, "--model" if split and not args.params else None)
    tp_traffic = _tp_traffic(args, result) if args.model else None
    transformer = any(n.key == "tensor_parallel_degree" for n in result.notes)
    own = given_settings(os.environ)  # SMP2DS_* variables that change the step: shown, never SMP keys
    _draw(args, result)
    if args.scale:
        summary = scale.scale_summary(estimate, result.topology)
        text = report.dump_json(summary) if args.format == "json" else scale.render_scale_text(
            summary, source_name(args.file)
        )
        write_stdout(text)
        return EXIT_OK
    if args.format == "json":
        write_stdout(
            report.dump_json(
                {
                    "topology": result.topology,
                    "backend": result.engine["backend"],
                    "keys": [n.to_dict() for n in result.notes],
                    "counts": report.fate_counts(result.notes),
                    "remarks": list(result.remarks),
                    "estimate": estimate,
                    **({"pipeline_split": split.plan.to_dict(), "model": split.architecture} if split else {}),
                    **({"tensor_parallel_traffic": tp_traffic} if tp_traffic else {}),
                    **({"transformer_options": transformer_options.options_json()} if transformer else {}),
                    **({"smp2ds_settings": own} if own else {}),
                }
            )
        )
        return EXIT_OK
    parts = [
        f"keys ({report.render_fate_summary(result.notes)}):\n" + report.render_key_table(result.notes),
        report.render_mapping("topology", result.topology),
        _backend_text(result.engine["backend"]),
        report.render_remarks(result.remarks),
        _split_text(split) if split else "",
        _tp_text(tp_traffic) if tp_traffic else "",
        _transformer_text() if transformer else "",
        _own_settings_text(own) if own else "",
        report.render_estimate_text(estimate)
        + ("" if params else "(no --params given: figures are for 1e9 parameters and scale linearly)\n"),
    ]
    write_stdout("\n".join(p for p in parts if p))
    return EXIT_OK


def _memory(args: argparse.Namespace, config: SMPConfig, result: Plan, layout: Layout) -> int:
    """``--memory`` / ``--fit``: the per-role peak, or the layouts that fit (see ``cli/memory.py``)."""

    if args.fit:
        found = memory.fit_report(args, config, result, layout)
        write_stdout(report.dump_json(found) if args.format == "json" else memory.render_fit_text(found))
        return EXIT_OK
    figures = memory.memory_report(args, config, result)
    write_stdout(report.dump_json(figures) if args.format == "json" else memory.render_memory_text(figures))
    return EXIT_OK


def _add_drawing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--diagram",
        type=output_path,
        metavar="FILE.svg|.png",
        help="also draw the rank grid: nodes, each rank's pp stage / tp rank / rdp rank (and sdp shard group), "
        "and the groups that communicate, per kind (needs matplotlib: pip install 'smp2ds[plot]')",
    )
    parser.add_argument(
        "--schedule",
        type=output_path,
        metavar="FILE.svg|.png",
        help="also draw the pipeline schedule the engine runs: forward and backward passes per micro-batch and "
        "stage over time, the bubble shaded (needs matplotlib)",
    )


def _draw(args: argparse.Namespace, result: Plan) -> None:
    """Write the pictures asked for; the note goes to stderr so stdout stays the report (maybe JSON)."""
    import sys


    if args.diagram:
        try:
            grid = data.rank_grid(result.topology)
        except ValueError as err:
            raise UsageError(str(err)) from None
        diagram.render_grid(grid, args.diagram)
        sys.stderr.write(f"wrote the rank grid to {args.diagram}\n")
    if args.schedule:
        pipeline = result.engine["pipeline"]
        if int(pipeline["stages"]) < 2:
            raise UsageError("--schedule draws a pipeline, but pipeline_parallel_degree is 1 in this configuration")
        timeline = data.schedule_timeline(pipeline)
        diagram.render_timeline(timeline, args.schedule)
        sys.stderr.write(f"wrote the pipeline schedule to {args.schedule} ({timeline.note})\n")


DEFAULT_PARAMS = 1_000_000_000
"""Without ``--params`` the estimate is shown for 1e9 parameters (it scales linearly)."""


def _estimate(result: Plan, params: int | None, source: str | None = None) -> dict[str, Any]:
    """Call the translator's estimator (formulas of docs/internals.md#cost-model) and make it JSON."""

    value = report.to_jsonable(estimate(result, params or DEFAULT_PARAMS))
    value["n_params_source"] = source or ("--params" if params else "default 1e9 (pass --params for your model)")
    return value


def _model_split(path: str, config: SMPConfig) -> Any:
    """The pipeline split of the model in ``path`` under ``config`` (engine code: imports torch)."""

    model_config = load_document(path)
    if not isinstance(model_config, dict):
        raise UsageError(f"--model {path}: expected a JSON object (a Hugging Face config.json)")
    import contextlib
    import sys

    # `explain --model` builds the model (torch, transformers, DeepSpeed), only when asked. DeepSpeed logs to
    # stdout when imported; keep stdout for the report (it may be JSON).
    with contextlib.redirect_stdout(sys.stderr):
        from smp2ds.engine.pipeline.explain import split_for_model_config  # see above

        try:
            return split_for_model_config(model_config, config.params)
        except ValueError as err:
            raise UsageError(f"--model {path}: {err}") from None


_LAYERS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model")
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx")


def _tp_traffic(args: argparse.Namespace, result: Plan) -> dict[str, Any] | None:
    """Tensor-parallel all-reduce traffic for the --model config, when tensor parallelism is on."""

    tp = result.topology_settings.tensor_parallel_degree
    if tp == 1:
        return None
    if not args.batch_size:
        raise UsageError("--model with tensor_parallel_degree > 1 needs --batch-size (the per-rank batch) "
                         "for the tensor-parallel traffic estimate")
    config = load_document(args.model)

    def first(names: tuple[str, ...], what: str) -> int:
        for name in names:
            if isinstance(config.get(name), int):
                return int(config[name])
        raise UsageError(f"--model {args.model}: no {what} ({' / '.join(names)}) in the config")

    seq_len = args.seq_len or first(_POSITIONS, "maximum sequence length; or pass --seq-len")
    half = any(result.deepspeed.get(k, {}).get("enabled") for k in ("fp16", "bf16"))
    try:
        return tensor_parallel_traffic(
            tp=tp, layers=first(_LAYERS, "layer count"), hidden=first(_HIDDEN, "hidden size"), seq_len=seq_len,
            batch_per_rank=args.batch_size, microbatches=result.engine_settings.microbatches,
            bytes_per_element=2 if half else 4,
            prescaled_batch=result.engine_settings.tensor_parallel.prescaled_batch,
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def _backend_text(backend: Any) -> str:
    """The engine backend the planner chose (what ``smp.DistributedModel`` builds)."""
    return f"backend: {backend['name']}\n  {backend['reason']}\n"


def _tp_text(t: dict[str, Any]) -> str:
    mib = 2**20
    return (f"tensor-parallel traffic (Megatron: {t['all_reduces_per_layer_and_step']} all-reduces per layer and "
            f"step over {t['tensor_parallel_degree']} ranks, layer batch {t['layer_batch']}):\n"
            f"  all-reduce buffers  {t['all_reduce_buffer_bytes_per_layer_and_step'] / mib:,.2f} MiB per layer "
            "and step\n"
            f"  ring bytes per rank {t['ring_bytes_per_rank_per_step'] / mib:,.2f} MiB per step "
            f"({t['layers']} layers)\n")


def _transformer_text() -> str:
    return ("distributed transformer settings (smp.model_creation / smp.tensor_parallelism keywords, "
            "smp.nn.DistributedTransformer* arguments):\n"
            + report.table(["setting", "fate", "what the engine does"], transformer_options.option_rows()))


def _own_settings_text(rows: list[dict[str, str]]) -> str:
    return ("smp2ds settings (environment variables, not SMP keys):\n"
            + report.table(["variable", "value", "fate", "what the engine does"],
                           [[r["name"], r["value"], r["fate"], r["effect"]] for r in rows]))


def _split_text(split: Any) -> str:
    plan = split.plan
    lines = [f"pipeline split of {split.architecture} ({split.n_params:,} parameters) into "
             f"{len(plan.stages)} stage(s), {plan.method}"
             + (f", memory_weight {plan.memory_weight:g}:" if plan.method == "auto" else ":")]
    for s in plan.stages:
        span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
        lines.append(f"  stage {s.stage}: layers {s.start}-{s.stop - 1} [{span}], "
                     f"{s.memory_bytes / 2**20:,.1f} MiB parameters, cost share {s.cost:.0%}")
    return "\n".join(lines) + "\n"
