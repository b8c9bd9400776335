"""``smp2ds port SCRIPT.py [-o OUT.py] [--config SMP_PARAMS.json] [--report REPORT]``: an SMP v1 script rewritten
into a plain PyTorch + DeepSpeed script (``translator/tools/port.py``), with the DeepSpeed config of the job's
layout written beside it (``OUT`` with ``.deepspeed.json``), which the ported script finds by itself.

Exit codes: 0 nothing left for a person (also: no SMP call, "nothing to port", the output equal to the input),
1 the report lists places left for a person, 2 a script that does not parse (line and column) or an output that
exists without ``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from smp2ds.translator.load import load_document
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout, Plan
from smp2ds.translator.planner import plan as make_plan
from smp2ds.translator.tools.native_deepspeed import AUTOTP_REFUSED, native_config

from . import EXIT_OK, UsageError, command_parser, positive_int

EXIT_MANUAL = 1
CHECKPOINT_NOTE = ("checkpoints: the ported script saves and resumes DeepSpeed's layout (DIR/TAG/ and DIR/latest), "
                   "not SMP's; a checkpoint SMP (or smp2ds) wrote continues after `smp2ds checkpoint export CKPT "
                   "--to deepspeed-universal OUT` (then the config's checkpoint.load_universal), or from its weights "
                   "after `--to hf` (docs/leaving-smp.md)")


def port_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``port`` (or build a standalone parser when ``subparsers`` is None)."""
    parser = command_parser(subparsers, "port", "Rewrite an SMP v1 script into a plain PyTorch + DeepSpeed script: "
                            "what has an exact equivalent is rewritten, the rest is marked '# smp2ds port:' and "
                            "listed in the report; a DeepSpeed config for the job's layout is written beside it.")
    parser.add_argument("script", metavar="SCRIPT", help="the SMP script (.py)")
    parser.add_argument("-o", "--output", metavar="OUT", help="the ported script (default: SCRIPT_deepspeed.py)")
    parser.add_argument("--config", metavar="FILE", help="the job's SMP parameters or estimator (JSON; default: "
                        "SMP's defaults)")
    parser.add_argument("--report", metavar="FILE", help="write the Markdown report there (default: standard output)")
    parser.add_argument("--batch-size", type=positive_int, metavar="B", help="the per-rank batch the script feeds "
                        "one step (default: nominal, DeepSpeed then sizes only its own data loader wrong)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT and its DeepSpeed config if they exist")
    parser.set_defaults(handler=port_command)
    return parser


def port_command(args: argparse.Namespace) -> int:
    """Run ``port``; returns the exit code (see the module docstring)."""
    try:
        import libcst

        # libcst parses only here: no other command pays for it at start-up
        from smp2ds.translator.tools.port import port_source, report
    except ImportError as exc:
        raise UsageError(f"smp2ds port needs libcst ({exc}); install it with pip install 'smp2ds[port]'") from None

    out = args.output or os.path.splitext(args.script)[0] + "_deepspeed.py"
    config_path = os.path.splitext(out)[0] + ".deepspeed.json"
    for path in (out, config_path):
        if os.path.exists(path) and not args.overwrite:
            raise UsageError(f"{path} exists; pass --overwrite to replace it")
    try:
        with open(args.script, encoding="utf-8") as handle:
            source = handle.read()
    except OSError as exc:
        raise UsageError(f"{args.script}: {exc.strerror}") from None
    plan = _plan(args)
    topo = plan.topology_settings
    try:
        result = port_source(source, config_name=os.path.basename(config_path),
                             microbatches=plan.engine_settings.batch.microbatches,
                             tensor_parallel=topo.tensor_parallel_degree,
                             pipeline_parallel=topo.pipeline_parallel_degree)
    except libcst.ParserSyntaxError as exc:
        sys.stderr.write(f"smp2ds port: {args.script}:{exc.editor_line}:{exc.editor_column}: does not parse: "
                         f"{exc.message}\n")
        return 2
    _write(out, result.code)
    if not result.ported:
        sys.stderr.write(f"smp2ds port: {args.script}: nothing to port (no {'smdistributed.modelparallel.torch'} "
                         f"import); wrote it unchanged to {out}\n")
        return EXIT_OK
    ds_config, notes = _deepspeed_config(plan, args.batch_size is None, result.families)
    if result.checkpoints:
        notes.append(CHECKPOINT_NOTE)
    _write(config_path, json.dumps(ds_config, indent=2) + "\n")
    text = report(result, args.script, notes)
    if args.report:
        _write(args.report, text)
    else:
        sys.stdout.write(text)
    sys.stderr.write(f"smp2ds port: wrote {out} and {config_path}; {len(result.manual)} place(s) left for a person"
                     + (" (marked '# smp2ds port:')" if result.manual else "") + "\n")
    return EXIT_MANUAL if result.manual else EXIT_OK


def _plan(args: argparse.Namespace) -> Any:
    document = load_document(args.config) if args.config else {}
    params = normalize(document, None).params
    # the smallest world that holds the layout: the DeepSpeed config leaves train_batch_size to DeepSpeed, so the
    # ported script runs at any multiple of it
    world = (int(params.get("pipeline_parallel_degree", 1)) * int(params.get("tensor_parallel_degree", 1))
             * max(1, int(params.get("sharded_data_parallel_degree", 1))))
    layout = Layout(world_size=world, gpus_per_node=None, batch_size=args.batch_size or int(params["microbatches"]))
    return make_plan(normalize(document, layout), layout)


def _deepspeed_config(plan: Plan, nominal: bool, families: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The job's native DeepSpeed config without ``train_batch_size`` (DeepSpeed derives it at any world size).
    ``families``: those the script builds for tensor parallelism; one AutoTP refuses is marked in the script (with
    the route that works), so the config is still written for the layout asked."""
    allowed = [f for f in families if f not in AUTOTP_REFUSED]
    model_type = allowed[0] if len(allowed) == 1 and len(families) == 1 else None
    config, notes = native_config(plan, model_type=model_type, pipelines_by_hand=True,
                                  unknown_family="the script does not build a model class that names its family "
                                                 "inside model_creation(tensor_parallelism=True): check yours")
    config.pop("train_batch_size", None)
    if nominal:
        notes.append("train_micro_batch_size_per_gpu is nominal (no --batch-size): DeepSpeed uses it for its own data "
                     "loader and throughput figures only; the script feeds its batches itself")
    return config, notes


def _write(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.smp2ds-tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)
