"""``smp2ds doctor``: can this machine run the job, and what to fix.

Reads facts without importing torch or DeepSpeed and without building anything (versions from
package metadata, GPUs from ``nvidia-smi``, DeepSpeed's ops from its install record and the torch
extensions cache), then judges them with ``smp2ds.translator.tools.doctor``. Exit 0 when nothing is a
problem, 1 with one line per problem and its fix.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys
from collections.abc import Mapping
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from smp2ds.translator.issues import SMPConfigError
from smp2ds.translator.load import load_document
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout, Plan, SMPConfig
from smp2ds.translator.planner import plan
from smp2ds.translator.tools import doctor as rules
from smp2ds.translator.world_layout import smallest_world

from . import UsageError, add_format_arg, command_parser, positive_int, report, write_stdout
from .machine import detect_gpu_memory, detect_gpus
from .memory import fit_warning

_NCCL_DISTS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


def doctor_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``doctor`` (or build a standalone parser when ``subparsers`` is None)."""
    parser = command_parser(
        subparsers, "doctor",
        "Check this machine for an SMP job: dependency versions, CUDA/NCCL or CPU, DeepSpeed's ops, mpirun, "
        "the launch environment and, with --config, whether the layout fits the visible devices.",
    )
    parser.add_argument("--config", metavar="FILE",
                        help="SMP parameters or estimator spec (JSON) to check against this machine")
    parser.add_argument("--world-size", type=positive_int, metavar="N",
                        help="processes of the job (default: $WORLD_SIZE, else what the visible devices hold)")
    parser.add_argument("--nnodes", "--nodes", dest="nodes", type=positive_int, metavar="N",
                        help="nodes the job runs on, each like this one (as launch --nnodes; --nodes is the older "
                        "spelling; default: the estimator's instance_count, else 1)")
    parser.add_argument("--model", metavar="MODEL",
                        help="with --config: check that one training step of this model (config.json, model "
                        "directory or module:function) fits the first visible GPU (or SMP2DS_GPU_MEMORY); the batch "
                        "and sequence come from the hyperparameters, --batch-size and --seq-len")
    parser.add_argument("--batch-size", type=positive_int, metavar="B", help="with --model: the per-rank batch")
    parser.add_argument("--seq-len", type=positive_int, metavar="S", help="with --model: tokens per sample")
    add_format_arg(parser)
    parser.set_defaults(handler=doctor_command)
    return parser


def doctor_command(args: argparse.Namespace) -> int:
    """Run every check; print the report; 0 when no problem was found, else 1."""

    env = dict(os.environ)
    machine = rules.Machine(gpus=detect_gpus(), torch_cuda=_torch_cuda(), nccl=_nccl(), cpus=os.cpu_count() or 1,
                            mpirun=shutil.which("mpirun"), compiler=_compiler(env), ds_ops=_ds_ops(env))
    findings = rules.check_versions({name: _version(name) for name in rules.TESTED})
    findings += rules.check_devices(machine)
    findings += rules.check_mpi(machine)
    findings += rules.check_launch_env(env)
    config_findings, deepspeed_config = _config(args, env, machine)
    findings += rules.check_ops(machine, rules.ops_needed(machine, deepspeed_config))
    findings += config_findings
    code = rules.exit_code(findings)
    if args.format == "json":
        write_stdout(report.dump_json({"ok": code == 0, "findings": [f.to_dict() for f in findings]}))
    else:
        write_stdout(render_text(findings))
    return code


_MARK = {"ok": "ok     ", "info": "info   ", "warn": "warn   ", "problem": "PROBLEM"}


def render_text(findings: list[rules.Finding]) -> str:
    """One line per finding; a problem's fix on the same line, after ``fix:``."""
    lines = [f"{_MARK[f.status]} {f.check}: {f.detail}" + (f"  fix: {f.fix}" if f.fix else "") for f in findings]
    problems = sum(f.status == "problem" for f in findings)
    lines.append(f"{problems} problem(s)" if problems else "all checks passed")
    return "\n".join(lines) + "\n"


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _package_dir(name: str) -> Path | None:
    # find_spec of a top-level name locates the package without importing it.
    spec = find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


def _torch_cuda() -> bool:
    lib = (_package_dir("torch") or Path("/nonexistent")) / "lib"
    return any(lib.glob("libtorch_cuda*"))


def _nccl() -> bool:
    lib = (_package_dir("torch") or Path("/nonexistent")) / "lib"
    return any(lib.glob("libnccl*")) or any(_version(d) for d in _NCCL_DISTS)


def _compiler(env: dict[str, str]) -> str | None:
    return next((found for c in (env.get("CXX"), "c++", "g++", "clang++") if c and (found := shutil.which(c))), None)


def _ds_ops(env: dict[str, str]) -> dict[str, bool]:
    """Op -> usable without compiling: prebuilt when DeepSpeed was installed, or in the JIT cache."""
    ops: dict[str, bool] = {}
    root = _package_dir("deepspeed")
    record = root / "git_version_info_installed.py" if root else None
    if record and record.is_file():
        # DeepSpeed's setup.py writes the ops it prebuilt here (ds_report reads the same record).
        for node in ast.parse(record.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "installed_ops" for t in node.targets):
                ops.update({k: bool(v) for k, v in ast.literal_eval(node.value).items()})
    cache = Path(env.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_"
    # torch keeps JIT builds in <cache>/py311_cpu/<op>/<op>.so (or without the py311_cu121 level
    # when TORCH_EXTENSIONS_DIR is set by hand); either counts.
    for so in [*cache.glob(f"{tag}*/*/*.so"), *cache.glob("*/*.so")]:
        if so.stem == so.parent.name:
            ops[so.stem] = True
    return ops


def _config(args: argparse.Namespace, env: dict[str, str],
            machine: rules.Machine) -> tuple[list[rules.Finding], Mapping[str, Any] | None]:
    """Findings about ``--config`` and ``SM_HP_MP_PARAMETERS``, and the planned DeepSpeed config."""

    findings: list[rules.Finding] = []
    doc: Any = load_document(args.config) if args.config else None
    if "SM_HP_MP_PARAMETERS" in env:
        overrides, findings = rules.parse_mp_parameters(env["SM_HP_MP_PARAMETERS"])
        if overrides is not None:
            # smp.init applies the variable over the script's dict key by key, the variable winning.
            doc = {**doc, **overrides} if isinstance(doc, dict) else overrides
    if doc is None:
        return findings, None
    where = "--config" if args.config else "SM_HP_MP_PARAMETERS"
    explicit = args.world_size or _int(env.get("WORLD_SIZE"))
    layout = Layout(world_size=explicit, gpus_per_node=machine.gpus or None) if explicit else None
    nodes = args.nodes
    try:
        config = normalize(doc, layout)
        try:
            result = plan(config, layout)  # an estimator spec knows its world and nodes itself
            nodes = nodes or (result.topology_settings.nodes if layout is None else 1)
        except SMPConfigError as err:
            if explicit or not any("world size" in i.message and "unknown" in i.message for i in err.issues):
                raise
            # A bare parameter dict: as many ranks as this machine's GPUs hold, in whole multiples of
            # the degrees (at least one model replica).
            least = smallest_world(config)
            nodes = nodes or 1
            world = max(least, machine.gpus * nodes // least * least)
            result = plan(config, Layout(world_size=world, gpus_per_node=machine.gpus or None))
    except SMPConfigError as err:
        findings += [rules.Finding(where, "problem", f"{i.pointer or '/'}: {i.message}", i.hint or "")
                     for i in err.issues]
        return findings, None
    topo = result.topology_settings
    findings.append(rules.Finding(where, "ok", f"valid: pp={topo.pipeline_parallel_degree} "
                                  f"tp={topo.tensor_parallel_degree} rdp={topo.rdp_degree}"))
    findings += rules.check_layout(topo.world_size, topo.ranks_per_node, machine, nodes)
    findings += [rules.Finding("placement", "warn", remark.removeprefix("warning: "), "")
                 for remark in result.remarks if remark.startswith("warning: placement_strategy")]
    if args.model:
        findings.append(_memory_fit(args, config, result))
    return findings, result.deepspeed


def _memory_fit(args: argparse.Namespace, config: SMPConfig, result: Plan) -> rules.Finding:
    """``--model``: one training step of the model on this machine's first GPU (explain --memory's estimate)."""

    device = detect_gpu_memory()
    if device is None:
        return rules.Finding("memory", "info", "no GPU visible: the memory of one step of --model was not checked "
                             "(SMP2DS_GPU_MEMORY=80GiB checks against a size)")
    if args.batch_size:
        topo = result.topology_settings
        result = plan(config, Layout(world_size=topo.world_size, gpus_per_node=topo.ranks_per_node,
                                     batch_size=args.batch_size))
    try:
        fits, line = fit_warning(args.model, config, result, device, seq_len=args.seq_len)
    except UsageError as err:
        return rules.Finding("memory", "warn", f"not checked: {err}")
    if fits:
        return rules.Finding("memory", "ok", line)
    return rules.Finding("memory", "warn", f"one training step does not fit: {line}",
                         f"smp2ds explain {args.config or 'FILE'} --model {args.model} --fit SIZE proposes layouts "
                         "that fit")


def _int(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() else None
