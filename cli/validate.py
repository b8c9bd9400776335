"""``smp2ds validate FILE``: report every problem of an SMP configuration at once.

Exit 0 when valid, 1 with the full list of issues otherwise. The verdict goes to stdout (it is
this command's output); ``--world-size`` adds the world-size arithmetic to the checks. Without a world size (a
bare parameter dict) everything else is checked, and the verdict says what was not.
"""

from __future__ import annotations

import argparse
from typing import Any

from smp2ds.translator import normalize, plan
from smp2ds.translator.issues import SMPConfigError
from smp2ds.translator.load import load_document
from smp2ds.translator.plan_types import Layout, Plan, SMPConfig
from smp2ds.translator.validate import validate
from smp2ds.translator.world_layout import resolve_layout, smallest_world

from . import (
    EXIT_INVALID,
    EXIT_OK,
    UsageError,
    add_file_arg,
    add_format_arg,
    add_layout_args,
    command_parser,
    layout_from_args,
    positive_int,
    report,
    source_name,
    write_stdout,
)
from .machine import detect_gpu_memory
from .memory import device_from_flag, fit_warning


def validate_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``validate`` (or build a standalone parser when ``subparsers`` is None)."""
    description = "Check an SMP configuration and print every problem with its JSON pointer."
    parser = command_parser(subparsers, "validate", description)
    add_file_arg(parser)
    add_layout_args(parser, gpus=False, batch=True)
    parser.add_argument("--model", metavar="MODEL",
                        help="also warn when one training step of this model (config.json, model directory or "
                        "module:function) does not fit the GPU: --gpu-memory, else the first visible one "
                        "(imports torch and transformers; see smp2ds explain --memory)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="with --model: the device (80GiB, h100, ...)")
    parser.add_argument("--seq-len", type=positive_int, metavar="S",
                        help="with --model: tokens per sample (default: the hyperparameters, else the model's "
                        "maximum)")
    add_format_arg(parser)
    parser.set_defaults(handler=validate_command)
    return parser


def validate_command(args: argparse.Namespace) -> int:
    """Run ``validate``; returns 0 (valid) or 1 (invalid)."""

    source = source_name(args.file)
    layout = layout_from_args(args)
    warnings: list[str] = []
    try:
        doc = load_document(args.file)
        issues = list(validate(doc, layout))
        if not issues:
            issues, warnings, summary = _planned(doc, layout, args)
    except SMPConfigError as err:  # malformed JSON, duplicate keys, or normalize's own checks
        issues = list(err.issues)
    if issues:
        if args.format == "json":
            write_stdout(report.render_issues_json(issues, source))
        else:
            write_stdout(report.render_issues_text(issues, source))
        return EXIT_INVALID
    if args.format == "json":
        write_stdout(report.dump_json({"source": source, "valid": True, "issues": [], "warnings": warnings,
                                       **summary}))
    else:
        details = ", ".join(f"{k} {v}" for k, v in summary.items())
        write_stdout(f"{source}: valid SMP configuration ({details})\n" + "".join(f"  {w}\n" for w in warnings))
    return EXIT_OK


def _planned(doc: Any, layout: Layout, args: argparse.Namespace) -> tuple[list[Any], list[str], dict[str, Any]]:
    """Plan the valid document once: what ``smp.init`` would refuse (keys the plan calls ``unsupported``, so
    "valid" means it will start), the plan's warnings (layouts that run, but slowly: see ``explain``) and the
    summary. Without a world size the plan is made for the smallest world the degrees allow, and its warnings,
    which depend on the world, are not given."""
    from dataclasses import replace

    config = normalize(doc, layout)  # also re-checks the cross-key rules
    known = resolve_layout(config, layout).world_size is not None
    if not known:
        world = smallest_world(config)
        layout = replace(layout, world_size=world) if layout is not None else Layout(world_size=world)
    try:
        result = plan(config, layout)
        result.raise_if_unsupported()
    except SMPConfigError as err:
        return list(err.issues), [], {}
    warnings = [r for r in result.remarks if r.startswith("warning:")] if known else []
    summary = _summary(config, None if known else smallest_world(config))
    if args.model:
        fits, line = _memory(args, config, result)
        summary["memory"] = ("fits: " if fits else "does NOT fit: ") + line
        if not fits:
            warnings.append(f"warning: one training step does not fit: {line}; smp2ds explain FILE --model "
                            f"{args.model} --fit SIZE proposes layouts that do")
    return [], warnings, summary


def _memory(args: argparse.Namespace, config: SMPConfig, result: Plan) -> tuple[bool, str]:
    """``--model``: the largest role's peak against ``--gpu-memory`` or the first visible GPU."""

    device = device_from_flag(args.gpu_memory) if args.gpu_memory else detect_gpu_memory()
    if device is None:
        raise UsageError("--model needs a device to compare with: no GPU is visible here; pass --gpu-memory SIZE "
                         "(80GiB, h100, a100-40gb, ...)")
    return fit_warning(args.model, config, result, device, seq_len=args.seq_len)


def _summary(cfg: Any, smallest: int | None) -> dict[str, Any]:
    """What the valid document is; ``smallest``: the smallest world its degrees fit, when no world size was given."""
    out: dict[str, Any] = {"kind": cfg.kind, "strategy": cfg.strategy, "smp_version": cfg.smp_version}
    if smallest is not None:
        out["world_size"] = (f"not given: the world-size rules were not checked (pass --world-size N); the smallest "
                             f"world these degrees fit is {smallest}")
    if cfg.instance_type:
        out["instance_type"] = cfg.instance_type
    if cfg.instance_count:
        out["instance_count"] = cfg.instance_count
    out["keys_given"] = len(cfg.given)
    return out
