"""The ``smp2ds`` command line: ``validate``, ``convert``, ``explain``, ``launch`` and ``schema``.

Thin by design (CONTRIBUTING.md, convention 8): each subcommand lives in its own module with
``<name>_command_parser(subparsers)`` and ``<name>_command(args) -> int``; this module builds the
parser, runs the chosen command and turns every expected failure into a message and an exit code:

* 0  success;
* 1  invalid configuration (every problem printed with pointer, given value, allowed, hint);
* 2  usage or I/O error (argparse errors, unreadable input, refusing to overwrite a file);
* 3  internal error (a bug in smp2ds; the traceback is shown only with ``SMP2DS_DEBUG=1``).

Imports of the translator happen inside the commands, so ``smp2ds --help`` and the start-up
path stay cheap; nothing here imports torch or deepspeed (``launch`` runs them as subprocesses).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

COMMANDS: tuple[str, ...] = ("validate", "convert", "explain", "launch", "schema", "checkpoint", "doctor", "port")


class UsageError(Exception):
    """A problem with how the command was called (exit code 2), raised by subcommands."""


# ---------------------------------------------------------------------------------------------
# argument helpers shared by the subcommands


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``0`` or ``-3`` or ``2.5`` is a usage error)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def command_parser(subparsers: Any, name: str, description: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``: registered on ``subparsers``, or standalone when None."""
    if subparsers is None:
        return argparse.ArgumentParser(prog=f"smp2ds {name}", description=description)
    return subparsers.add_parser(name, help=SUMMARIES[name], description=description)


def add_file_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file",
        metavar="FILE",
        help="SMP parameters, estimator `distribution` dict, estimator spec or SMP v2 dict "
        "(JSON); `-` reads standard input",
    )


def add_layout_args(parser: argparse.ArgumentParser, *, gpus: bool = True, batch: bool = True) -> None:
    parser.add_argument(
        "--world-size",
        type=positive_int,
        metavar="N",
        help="total processes (default: instance_count x processes_per_host from the estimator)",
    )
    if gpus:
        parser.add_argument(
            "--gpus-per-node",
            type=positive_int,
            metavar="N",
            help="processes per node (default: mpi.processes_per_host, else GPUs of the instance type)",
        )
    if batch:
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            metavar="B",
            help="per-rank batch handed to the @smp.step function (enables micro-batch arithmetic)",
        )


def add_format_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format", choices=("text", "json"), default="text", help="output for people or one JSON object"
    )


def layout_from_args(args: argparse.Namespace) -> Any:
    """The `Layout` the flags describe, or None when no layout flag was given."""
    values = {name: getattr(args, name, None) for name in ("world_size", "gpus_per_node", "batch_size")}
    if all(v is None for v in values.values()):
        return None
    from smp2ds.translator.plan_types import Layout  # start-up: the entry module loads only what --help needs

    return Layout(**values)


def source_name(path: str) -> str:
    return "<stdin>" if path == "-" else path


# ---------------------------------------------------------------------------------------------
# parser and entry point


SUMMARIES: dict[str, str] = {
    "validate": "check an SMP configuration",
    "convert": "translate to DeepSpeed / Megatron / launcher / plan",
    "explain": "key fates, memory and communication",
    "launch": "run an SMP script on DeepSpeed",
    "schema": "list, print or locate the JSON Schemas (editor setup)",
    "checkpoint": "inspect, consolidate, export or reshard SMP checkpoints (offline)",
    "port": "rewrite an SMP script into a plain PyTorch + DeepSpeed script",
    "doctor": "check this machine for a job: versions, devices, ops, launch env",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``smp2ds`` parser with every subcommand registered.

    With ``only``, just that subcommand gets its full set of flags and the others are
    registered by name (enough for ``--help`` and "invalid choice" messages); this keeps the
    other subcommand modules out of the start-up path.
    """
    from importlib import import_module

    parser = argparse.ArgumentParser(
        prog="smp2ds",
        description="Run SageMaker model parallel (SMP v1) configurations on DeepSpeed: validate, "
        "convert and explain SMP configs, and launch unchanged SMP scripts.",
    )
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="print the version and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        if only is None or only == name:
            module = import_module(f"{__name__}.{name}")
            getattr(module, f"{name}_command_parser")(subparsers)
        else:
            subparsers.add_parser(name, help=SUMMARIES[name], add_help=False)
    return parser


class _VersionAction(argparse.Action):
    # importlib.metadata is only imported when --version is asked for (start-up budget).
    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("smp2ds")
        except PackageNotFoundError:
            text = "unknown (not installed)"
        parser.exit(0, f"smp2ds {text}\n")


def _chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first word that is not an option)."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _split_launch_argv(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """For ``launch``, everything after the first ``--`` is the script and its arguments.

    argparse's REMAINDER handling of ``--`` differs between Python versions, so the split is
    done here, before parsing, and only for the launch subcommand.
    """
    if _chosen_command(argv) != "launch" or "--" not in argv:
        return argv, None
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``smp2ds`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, script = _split_launch_argv(argv)
    parser = build_parser(only=_chosen_command(own))
    typo = _underscore_flag(parser, own)
    if typo is not None:
        _write(sys.stderr, typo)
        return EXIT_USAGE
    try:
        args = parser.parse_args(own)
    except SystemExit as stop:  # argparse: --help (0) or a usage error (2)
        return int(stop.code) if isinstance(stop.code, int) else EXIT_USAGE
    if args.command == "launch":
        args.script_argv = script or []
    return run_guarded(args.handler, args)


def _underscore_flag(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """A message for a flag spelled with underscores where the command's flag has hyphens (``--world_size``),
    which argparse would answer with the top-level usage and no hint; None when there is none."""
    command = _chosen_command(argv)
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    sub = actions[0].choices.get(command) if actions and command else None
    if sub is None:
        return None
    known = set(sub._option_string_actions)
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and "_" in flag and flag not in known and flag.replace("_", "-") in known:
            return (f"smp2ds {command}: error: unknown flag {flag}; did you mean {flag.replace('_', '-')}? "
                    "(smp2ds's flags are spelled with hyphens)\n")
    return None


def run_guarded(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a subcommand, mapping expected failures to messages and exit codes (never a traceback)."""
    from smp2ds.translator.issues import InputError, SMPConfigError  # start-up: as above, once a command runs

    # `launch --config FILE` names its document `config`; every other command `file`
    source = source_name(getattr(args, "file", None) or getattr(args, "config", None) or "")
    try:
        return handler(args)
    except SMPConfigError as err:
        # validate prints its own verdict; other commands keep stdout for their artifact.
        from . import report

        fmt = getattr(args, "format", "text")
        render = report.render_issues_json if fmt == "json" else report.render_issues_text
        _write(sys.stderr, render(err.issues, source or "input"))
        return EXIT_INVALID
    except UsageError as err:
        _write(sys.stderr, f"smp2ds {args.command}: error: {err}\n")
        return EXIT_USAGE
    except InputError as err:
        _write(sys.stderr, f"smp2ds {args.command}: error: {err}\n")
        return EXIT_USAGE
    except OSError as err:
        _write(sys.stderr, f"smp2ds {args.command}: error: {_os_error_text(err)}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _write(sys.stderr, "smp2ds: interrupted\n")
        return 130
    except Exception as err:  # a bug: say so briefly, keep the traceback behind a switch
        if os.environ.get("SMP2DS_DEBUG"):
            raise
        _write(
            sys.stderr,
            f"smp2ds {args.command}: internal error: {type(err).__name__}: {err}\n"
            "  (this is a bug in smp2ds; rerun with SMP2DS_DEBUG=1 for the traceback and report it)\n",
        )
        return EXIT_INTERNAL


def _os_error_text(err: OSError) -> str:
    if err.filename is not None and err.strerror:
        return f"{err.strerror}: {err.filename}"
    return str(err)


def _write(stream: Any, text: str) -> None:
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:  # `smp2ds ... | head` closed the pipe: nothing left to say
        pass


def write_stdout(text: str) -> None:
    """Print to stdout, tolerating a reader that went away (``| head``)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
