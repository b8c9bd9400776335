"""``smp2ds explain FILE``: what happens to every key, and what the layout costs per rank.

Prints the key-fate table (key, value, fate, target pointer or reason), the plan's topology and
remarks, then the per-rank model-state memory and the communication volume per optimizer step
computed by ``smp2ds.translator.estimate.estimate`` for ``--params`` parameters.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from . import (
    EXIT_OK,
    SUMMARIES,
    add_file_arg,
    add_format_arg,
    add_layout_args,
    layout_from_args,
    write_stdout,
)

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
    if subparsers is None:
        parser = argparse.ArgumentParser(prog="smp2ds explain", description=description)
    else:
        parser = subparsers.add_parser("explain", help=SUMMARIES["explain"], description=description)
    add_file_arg(parser)
    parser.add_argument(
        "--params",
        type=parameter_count,
        metavar="COUNT",
        help="model parameters for the memory/communication estimate (30e9, 30B, 350M)",
    )
    add_layout_args(parser)
    add_format_arg(parser)
    parser.set_defaults(handler=explain_command)
    return parser


def explain_command(args: argparse.Namespace) -> int:
    """Run ``explain``; returns 0, or raises for the guard in ``cli.run_guarded`` to report."""
    from smp2ds.translator.load import load_document
    from smp2ds.translator.normalize import normalize
    from smp2ds.translator.planner import plan

    from . import report

    layout = layout_from_args(args)
    config = normalize(load_document(args.file), layout)
    result = plan(config, layout)
    estimate = _estimate(result, args.params)
    if args.format == "json":
        write_stdout(
            report.dump_json(
                {
                    "topology": result.topology,
                    "keys": [n.to_dict() for n in result.notes],
                    "counts": report.fate_counts(result.notes),
                    "remarks": list(result.remarks),
                    "estimate": estimate,
                }
            )
        )
        return EXIT_OK
    parts = [
        f"keys ({report.render_fate_summary(result.notes)}):\n" + report.render_key_table(result.notes),
        report.render_mapping("topology", result.topology),
        report.render_remarks(result.remarks),
        report.render_estimate_text(estimate)
        + ("" if args.params else "(no --params given: figures are for 1e9 parameters and scale linearly)\n"),
    ]
    write_stdout("\n".join(p for p in parts if p))
    return EXIT_OK


DEFAULT_PARAMS = 1_000_000_000
"""Without ``--params`` the estimate is shown for 1e9 parameters (it scales linearly)."""


def _estimate(result: Any, params: int | None) -> dict[str, Any]:
    """Call the translator's estimator (formulas of mapping-anchors section 1.2) and make it JSON."""
    from smp2ds.translator.estimate import estimate

    from . import report

    value = report.to_jsonable(estimate(result, params or DEFAULT_PARAMS))
    value["n_params_source"] = "--params" if params else "default 1e9 (pass --params for your model)"
    return value
