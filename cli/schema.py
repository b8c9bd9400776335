"""``smp2ds schema``: the installed JSON Schemas, for people, tools and editors.

Without flags it lists each schema's name, ``$id`` and installed file; ``--print NAME`` prints
one schema (NAME may be a name, a file name or an ``$id`` URL), ``--path NAME`` its file, and
``--vscode`` a ``json.schemas`` block for VS Code's settings that points at the installed files.
"""

from __future__ import annotations

import argparse
from typing import Any

from smp2ds import schemas

from . import EXIT_OK, UsageError, command_parser, report, write_stdout

VSCODE_FILE_MATCH: dict[str, list[str]] = {
    "estimator": ["*.estimator.json", "**/estimators/*.json"],
    "distribution": ["*.distribution.json"],
    "smp_v1": ["*.smp.json", "smp_parameters*.json"],
    "smp_v2": ["*.smp2.json"],
}
"""File name patterns the ``--vscode`` snippet maps to each schema (users adapt them)."""


def schema_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``schema`` (or build a standalone parser when ``subparsers`` is None)."""
    description = (
        "List the installed JSON Schemas (name, $id, file), print one (--print NAME, where NAME is a "
        "name, a file name or an $id URL), its file (--path NAME), or a VS Code json.schemas snippet (--vscode)."
    )
    parser = command_parser(subparsers, "schema", description)
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--print", dest="print_name", metavar="NAME", help="print the schema NAME (JSON)")
    what.add_argument("--path", dest="path_name", metavar="NAME", help="print the installed file of NAME")
    what.add_argument("--vscode", action="store_true", help="print a json.schemas block for VS Code settings")
    parser.add_argument(
        "--format", choices=("text", "json"), default="text", help="listing for people or one JSON object"
    )
    parser.set_defaults(handler=schema_command)
    return parser


def schema_command(args: argparse.Namespace) -> int:
    """Run ``schema``; returns 0, or raises UsageError for an unknown schema name."""

    try:
        if args.print_name:
            write_stdout(report.dump_json(schemas.load_schema(args.print_name)))
        elif args.path_name:
            write_stdout(schemas.schema_path(args.path_name) + "\n")
        elif args.vscode:
            write_stdout(report.dump_json({"json.schemas": vscode_settings()}))
        else:
            rows = [[n, schemas.schema_id(n), schemas.schema_path(n)] for n in schemas.SCHEMA_FILES]
            if args.format == "json":
                write_stdout(report.dump_json([dict(zip(("name", "id", "path"), row)) for row in rows]))
            else:
                write_stdout(report.table(["name", "$id", "file"], rows))
    except KeyError as err:
        raise UsageError(err.args[0]) from None
    return EXIT_OK


def vscode_settings() -> list[dict[str, Any]]:
    """VS Code ``json.schemas`` entries: file patterns -> the installed schema file (a file: URL)."""
    from pathlib import Path


    return [
        {"fileMatch": patterns, "url": Path(schemas.schema_path(name)).as_uri()}
        for name, patterns in VSCODE_FILE_MATCH.items()
    ]
