"""``smp2ds validate FILE``: report every problem of an SMP configuration at once.

Exit 0 when valid, 1 with the full list of issues otherwise. The verdict goes to stdout (it is
this command's output); ``--world-size`` adds the world-size arithmetic to the checks. Without a world size (a
bare parameter dict) everything else is checked, and the verdict says what was not.
"""

from __future__ import annotations

import argparse
from typing import Any

from . import (
    EXIT_INVALID,
    EXIT_OK,
    add_file_arg,
    add_format_arg,
    add_layout_args,
    command_parser,
    layout_from_args,
    source_name,
    write_stdout,
)


def validate_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``validate`` (or build a standalone parser when ``subparsers`` is None)."""
    description = "Check an SMP configuration and print every problem with its JSON pointer."
    parser = command_parser(subparsers, "validate", description)
    add_file_arg(parser)
    add_layout_args(parser, gpus=False, batch=False)
    add_format_arg(parser)
    parser.set_defaults(handler=validate_command)
    return parser


def validate_command(args: argparse.Namespace) -> int:
    """Run ``validate``; returns 0 (valid) or 1 (invalid)."""
    from smp2ds.translator.issues import SMPConfigError
    from smp2ds.translator.load import load_document
    from smp2ds.translator.validate import validate

    from . import report

    source = source_name(args.file)
    layout = layout_from_args(args)
    try:
        doc = load_document(args.file)
        issues = list(validate(doc, layout))
        if not issues:
            issues = _refusals(doc, layout)
        summary = _summary(doc, layout) if not issues else None
    except SMPConfigError as err:  # malformed JSON, duplicate keys, or normalize's own checks
        issues = list(err.issues)
        summary = None
    if issues:
        if args.format == "json":
            write_stdout(report.render_issues_json(issues, source))
        else:
            write_stdout(report.render_issues_text(issues, source))
        return EXIT_INVALID
    warnings = _warnings(doc, layout)
    if args.format == "json":
        write_stdout(report.dump_json({"source": source, "valid": True, "issues": [], "warnings": warnings,
                                       **(summary or {})}))
    else:
        details = ", ".join(f"{k} {v}" for k, v in (summary or {}).items())
        write_stdout(f"{source}: valid SMP configuration ({details})\n" + "".join(f"  {w}\n" for w in warnings))
    return EXIT_OK


def _warnings(doc: Any, layout: Any) -> list[str]:
    """The plan's warnings for a valid document (layouts that run, but slowly: see ``explain``)."""
    from smp2ds.translator import normalize, plan

    config = normalize(doc, layout)
    if _world_unknown(config, layout):
        return []
    return [r for r in plan(config, layout).remarks if r.startswith("warning:")]


def _refusals(doc: Any, layout: Any) -> list[Any]:
    """What ``smp.init`` would refuse (keys the plan calls ``unsupported``), so "valid" means it will start. Without
    a world size the plan is made for the smallest world the degrees allow (:func:`smallest_world`)."""
    from smp2ds.translator import normalize, plan
    from smp2ds.translator.issues import SMPConfigError

    try:
        config = normalize(doc, layout)
        if _world_unknown(config, layout):
            layout = _with_world(layout, smallest_world(config))
        plan(config, layout).raise_if_unsupported()
    except SMPConfigError as err:
        return list(err.issues)
    return []


def _world_unknown(config: Any, layout: Any) -> bool:
    from smp2ds.translator.layout import resolve_layout

    return resolve_layout(config, layout).world_size is None


def smallest_world(config: Any) -> int:
    """The fewest processes the configuration's degrees fit: pipeline x tensor x sharded-data-parallel degree."""
    params = config.params
    return (int(params.get("pipeline_parallel_degree", 1)) * int(params.get("tensor_parallel_degree", 1))
            * max(1, int(params.get("sharded_data_parallel_degree", 1))))


def _with_world(layout: Any, world: int) -> Any:
    from dataclasses import replace

    from smp2ds.translator.plan_types import Layout

    return replace(layout, world_size=world) if layout is not None else Layout(world_size=world)


def _summary(doc: Any, layout: Any) -> dict[str, Any]:
    """What the valid document is, from `normalize` (which also re-checks the cross-key rules)."""
    from smp2ds.translator.normalize import normalize

    cfg = normalize(doc, layout)
    out: dict[str, Any] = {"kind": cfg.kind, "strategy": cfg.strategy, "smp_version": cfg.smp_version}
    if _world_unknown(cfg, layout):
        out["world_size"] = (f"not given: the world-size rules were not checked (pass --world-size N); the smallest "
                             f"world these degrees fit is {smallest_world(cfg)}")
    if cfg.instance_type:
        out["instance_type"] = cfg.instance_type
    if cfg.instance_count:
        out["instance_count"] = cfg.instance_count
    out["keys_given"] = len(cfg.given)
    return out
