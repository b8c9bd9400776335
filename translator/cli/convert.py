"""``smp2ds convert FILE``: the DeepSpeed config (or Megatron args, launcher, whole Plan) for an SMP config.

``--to deepspeed`` (default) and ``--to megatron`` print JSON in both formats: the artifact *is*
JSON; in text format a one-line summary of the key fates goes to stderr so stdout stays a clean
file. ``--to launcher`` and ``--to plan`` have a text rendering for people and one JSON object
for tools (``--to plan --format json`` = ``Plan.to_dict()``). ``-o`` writes atomically and
refuses to replace an existing file unless ``--overwrite`` is given (exit 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from . import (
    EXIT_OK,
    UsageError,
    add_file_arg,
    add_format_arg,
    add_layout_args,
    command_parser,
    layout_from_args,
    write_stdout,
)

TARGETS: tuple[str, ...] = ("deepspeed", "megatron", "launcher", "plan")


def convert_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``convert`` (or build a standalone parser when ``subparsers`` is None)."""
    description = (
        "Translate an SMP configuration into a DeepSpeed config, Megatron arguments, launcher commands "
        "or the whole plan."
    )
    parser = command_parser(subparsers, "convert", description)
    add_file_arg(parser)
    add_layout_args(parser)
    parser.add_argument("--to", choices=TARGETS, default="deepspeed", help="what to produce (default: deepspeed)")
    parser.add_argument("-o", "--output", metavar="OUT", help="write to OUT instead of standard output")
    parser.add_argument("--overwrite", action="store_true", help="allow -o to replace an existing file")
    add_format_arg(parser)
    parser.set_defaults(handler=convert_command)
    return parser


def convert_command(args: argparse.Namespace) -> int:
    """Run ``convert``; returns 0, or raises for the guard in ``cli.run_guarded`` to report."""
    if args.overwrite and not args.output:
        raise UsageError("--overwrite only makes sense with -o/--output")
    if args.output and os.path.exists(args.output) and not args.overwrite:
        raise UsageError(f"{args.output} exists; pass --overwrite to replace it")

    from smp2ds.translator.load import load_document
    from smp2ds.translator.normalize import normalize
    from smp2ds.translator.planner import plan

    from . import report

    layout = layout_from_args(args)
    config = normalize(load_document(args.file), layout)
    result = plan(config, layout)
    text = render(result, args.to, args.format)
    if args.output:
        write_atomically(args.output, text)
        if args.format == "text":
            sys.stderr.write(f"smp2ds convert: wrote {args.to} to {args.output}\n")
    else:
        write_stdout(text)
    if args.format == "text" and args.to in ("deepspeed", "megatron"):
        sys.stderr.write(
            f"smp2ds convert: keys: {report.render_fate_summary(result.notes)}"
            " (`smp2ds explain` shows each key's fate)\n"
        )
        for remark in result.remarks:
            sys.stderr.write(f"smp2ds convert: note: {remark}\n")
    return EXIT_OK


def render(result: Any, target: str, fmt: str) -> str:
    """The text ``convert`` prints for ``--to target --format fmt``."""
    from . import report

    if target == "plan":
        return report.dump_json(result.to_dict()) if fmt == "json" else report.render_plan_text(result)
    section = getattr(result, target)
    if target == "launcher" and fmt == "text":
        return report.render_launcher_text(section)
    return report.dump_json(section)


def write_atomically(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder, then rename."""
    import tempfile  # only needed with -o; kept off the start-up path

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".smp2ds-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
