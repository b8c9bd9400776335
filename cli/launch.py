"""``smp2ds launch -- SCRIPT ARGS``: run an unchanged SMP script the way SageMaker would start it.

SageMaker's training toolkit exports the SMP parameters as ``SM_HP_MP_PARAMETERS`` and the
``sagemaker_*`` framework keys as ``SM_FRAMEWORK_PARAMS`` (docs/smp-semantics.md#launch-environment), then runs
mpirun. Here the same variables are set (taken from the plan's launcher section when it has
them) and the script runs under the deepspeed launcher, torchrun or mpirun, as a subprocess
whose exit code becomes ours. Without GPUs (no ``nvidia-smi``) the ranks run on the CPU with
gloo (``DS_ACCELERATOR=cpu``) and a notice says so. ``--dry-run`` prints instead of running.
Inside a Slurm allocation the node count, this node's rank, the master's address and the processes
per node default to what the ``SLURM_*`` variables say (``smp2ds.translator.tools.slurm_env``).

This module parses the flags, builds a `LaunchSpec`, runs it and reports; the environment and
the command line come from ``smp2ds.translator.launcher`` (shared with the plan's launcher
section), the machine probes from ``machine``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from smp2ds.translator.launcher import (
    LAUNCHERS,
    hostfile_text,
    hosts_for,
    launcher_command,
    local_environment,
    with_hyperparameters,
)
from smp2ds.translator.load import load_document
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan
from smp2ds.translator.tools.slurm_env import SlurmEnvError, in_allocation, launch_defaults

from . import EXIT_OK, UsageError, command_parser, positive_int, write_stdout
from .machine import detect_gpus, free_port, launcher_program
from .report import dump_json, render_launch_text

DEFAULT_MULTINODE_PORT = 29500


class LaunchSpec:
    """Everything a launch needs: the command line, the variables to add, messages for the user.

    ``hostfile`` is (path, content) of a hostfile to write before running (deepspeed across
    nodes); ``dirs`` are the folders the SM_* paths point at, created before running. A plain
    class rather than a dataclass: building a dataclass costs start-up time on every command.
    """

    __slots__ = ("command", "dirs", "env", "hostfile", "notices")

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        notices: list[str] | None = None,
        hostfile: tuple[str, str] | None = None,
        dirs: tuple[str, ...] = (),
    ) -> None:
        self.command = command
        self.env = env
        self.notices = notices or []
        self.hostfile = hostfile
        self.dirs = dirs


def launch_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``launch`` (or build a standalone parser when ``subparsers`` is None)."""

    description = (
        "Run an SMP training script with the SageMaker environment (SM_HP_MP_PARAMETERS, "
        "SM_FRAMEWORK_PARAMS, SM_HOSTS, ...) under the deepspeed launcher, torchrun or mpirun. "
        "Usage: smp2ds launch [options] -- SCRIPT [ARGS...]  (or -- -m MODULE [ARGS...])"
    )
    parser = command_parser(subparsers, "launch", description)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--estimator", metavar="FILE", help="estimator spec or distribution dict (JSON)")
    source.add_argument("--config", metavar="FILE", help="SMP parameters dict (JSON), as given to smp.init")
    parser.add_argument(
        "--nproc-per-node",
        type=positive_int,
        metavar="N",
        help="processes on this node (default: mpi.processes_per_host, else Slurm's SLURM_GPUS_ON_NODE or "
        "SLURM_NTASKS_PER_NODE, else GPU count, else 1)",
    )
    parser.add_argument(
        "--nnodes", type=positive_int, metavar="M",
        help="number of nodes (default: SLURM_NNODES inside srun, else 1; an estimator with instance_count > 1 "
        "needs it said)"
    )
    parser.add_argument("--node-rank", type=int, metavar="R",
                        help="rank of this node, 0..M-1 (default: SLURM_NODEID inside srun, else 0)")
    parser.add_argument("--master-addr", metavar="A",
                        help="address of node 0 (required when --nnodes > 1; default inside srun: the first host "
                        "of SLURM_JOB_NODELIST)")
    parser.add_argument(
        "--master-port",
        type=positive_int,
        metavar="P",
        help=f"rendezvous port (default: ddp_port from the config, else a free port on one node, "
        f"{DEFAULT_MULTINODE_PORT} across nodes)",
    )
    parser.add_argument(
        "--launcher", choices=LAUNCHERS, default="deepspeed", help="process launcher (default deepspeed)"
    )
    parser.add_argument(
        "--output-dir",
        metavar="DIR",
        default="smp2ds_output",
        help="where SM_MODEL_DIR (DIR/model) and SM_OUTPUT_DATA_DIR (DIR/output/data) point",
    )
    parser.add_argument(
        "--channel",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="an input channel: sets SM_CHANNEL_<NAME>=PATH (repeatable)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the environment and command, do not run"
    )
    parser.add_argument("--format", choices=("text", "json"), default="text", help="--dry-run output format")
    parser.set_defaults(handler=launch_command)
    return parser


def launch_command(args: argparse.Namespace) -> int:
    """Run ``launch``: build the spec, then print it (``--dry-run``) or run it and return its code."""
    spec = build_spec(args)
    if args.dry_run:
        if args.format == "json":
            hostfile = {"path": spec.hostfile[0], "content": spec.hostfile[1]} if spec.hostfile else None
            write_stdout(
                dump_json(
                    {"command": spec.command, "env": spec.env, "notices": spec.notices, "hostfile": hostfile}
                )
            )
        else:
            write_stdout(render_launch_text(spec.command, spec.env, spec.notices))
        return EXIT_OK
    for notice in spec.notices:
        sys.stderr.write(f"smp2ds launch: {notice}\n")
    sys.stderr.flush()
    return run(spec)


def run(spec: LaunchSpec) -> int:
    """Create the folders and hostfile, run the launcher with our variables added, return its code."""
    import subprocess

    for folder in spec.dirs:
        os.makedirs(folder, exist_ok=True)
    if spec.hostfile:
        with open(spec.hostfile[0], "w", encoding="utf-8") as handle:
            handle.write(spec.hostfile[1])
    env = {**os.environ, **spec.env}
    try:
        proc = subprocess.Popen(spec.command, env=env)
    except FileNotFoundError as err:
        raise UsageError(f"cannot start {spec.command[0]!r}: {err.strerror}") from None
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        # The launcher got the same SIGINT from the terminal; give it time to stop its ranks.
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    return 128 - code if code < 0 else code


# ---------------------------------------------------------------------------------------------
# building the spec


def build_spec(args: argparse.Namespace) -> LaunchSpec:
    """Resolve the layout, plan the config for it and assemble command and environment."""

    doc = _document(args)
    slurm = _slurm(args)
    if slurm is not None:
        args.nnodes = args.nnodes or slurm["nnodes"]
        args.node_rank = slurm["node_rank"] if args.node_rank is None else args.node_rank
        args.master_addr = args.master_addr or slurm["master_addr"]
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    args.nnodes = _nodes(args, doc)
    script = list(getattr(args, "script_argv", []) or []) or _entry_point(doc)
    if not script:
        raise UsageError(
            "nothing to run: put the training script after `--`, e.g. `smp2ds launch -- train.py --lr 1e-3`"
            + ("" if args.estimator is None else f" ({args.estimator} names no entry_point)")
        )
    if script == ["-m"]:
        raise UsageError("`-m` needs a module name after it")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(
            f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1} for --nnodes {args.nnodes}"
        )
    if args.nnodes > 1 and not args.master_addr:
        raise UsageError("--nnodes > 1 needs --master-addr (the address of node 0, the same on every node)")
    if args.nnodes > 1 and args.launcher == "mpirun":
        raise UsageError(
            "mpirun across nodes needs ssh between hosts; use --launcher torchrun or deepspeed, "
            "started once per node with --node-rank"
        )
    channels = parse_channels(args.channel)

    gpus = detect_gpus()
    config, planned, nproc = _plan(args, doc, (slurm and slurm["nproc"]) or gpus or 1)
    if config is not None:
        script = with_hyperparameters(script, config.hyperparameters)

    addr = args.master_addr or "127.0.0.1"
    ddp_port = _int(config.given.get("ddp_port")) if config is not None else None
    port = args.master_port or ddp_port or (DEFAULT_MULTINODE_PORT if args.nnodes > 1 else free_port())
    env = local_environment(
        planned,
        instance_type=config.instance_type if config is not None else None,
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        gpus=gpus,
        script=script,
        output_dir=os.path.abspath(args.output_dir),
        channels=channels,
        addr=addr,
        port=port,
        environ=os.environ,
        cpu_count=os.cpu_count() or 1,
    )
    hostfile = None
    if args.launcher == "deepspeed" and args.nnodes > 1:
        hostfile = (os.path.join(args.output_dir, "hostfile"), hostfile_text(hosts_for(args.nnodes), nproc))
    command = launcher_command(
        args.launcher,
        script,
        program=launcher_program(args.launcher),
        python=sys.executable,
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        addr=addr,
        port=port,
        env_names=sorted(env),
        hostfile=hostfile and hostfile[0],
    )
    dirs = tuple(
        env[k] for k in ("SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR", "SM_OUTPUT_INTERMEDIATE_DIR") if k in env
    )
    notices = _notices(config, gpus, nproc, args.nnodes)
    if slurm is not None:
        notices.insert(0, f"{slurm['source']} (defaults from SLURM_*; --nnodes, --node-rank, --master-addr and "
                       "--nproc-per-node override them)")
    return LaunchSpec(command=command, env=env, notices=notices, hostfile=hostfile, dirs=dirs)


def _document(args: argparse.Namespace) -> Any:
    """The ``--estimator`` / ``--config`` document, or None."""
    path = args.estimator or args.config
    if path is None:
        return None

    return load_document(path)


def _nodes(args: argparse.Namespace, doc: Any) -> int:
    """``--nnodes``; when not given, 1, unless the estimator runs on several instances: then the launch on
    each node must say which node it is."""
    if args.nnodes is not None:
        return int(args.nnodes)
    count = doc.get("instance_count") if isinstance(doc, dict) and args.estimator else None
    if isinstance(count, int) and not isinstance(count, bool) and count > 1:
        raise UsageError(
            f"{args.estimator} runs on instance_count {count} instances: start smp2ds launch once on each of your "
            f"{count} nodes with --nnodes {count} --node-rank R (R = 0..{count - 1}, 0 on the first node) "
            "--master-addr ADDRESS (the first node's address, the same on every node); or pass --nnodes 1 to run "
            "it on this node alone (the configuration is then checked for one node)")
    return 1


def _entry_point(doc: Any) -> list[str]:
    """The estimator's ``entry_point`` (under its ``source_dir``) as the script to run, or nothing."""
    entry = doc.get("entry_point") if isinstance(doc, dict) else None
    if not isinstance(entry, str) or not entry:
        return []
    source = doc.get("source_dir")
    return [os.path.join(source, entry) if isinstance(source, str) and source else entry]


def _slurm(args: argparse.Namespace) -> dict[str, Any] | None:
    """Slurm's defaults for this launch (``slurm_env.launch_defaults``), or None outside an allocation."""

    if not in_allocation(os.environ):
        return None
    try:
        return launch_defaults(os.environ, args.nnodes)
    except SlurmEnvError as err:
        raise UsageError(str(err)) from None


def _plan(args: argparse.Namespace, doc: Any, fallback: int) -> tuple[Any, dict[str, Any] | None, int]:
    """The config (checked against the world this launch runs), the plan's launcher env and the
    processes per node; (None, None, nproc) without ``--estimator`` / ``--config``. ``fallback``: the processes
    per node when neither ``--nproc-per-node`` nor the config's ``processes_per_host`` says (Slurm's, else the
    GPUs, else 1)."""
    if doc is None:
        return None, None, args.nproc_per_node or fallback

    nproc = args.nproc_per_node or _int(normalize(doc).mpi.get("processes_per_host")) or fallback
    layout = Layout(world_size=nproc * args.nnodes, gpus_per_node=nproc)
    config = normalize(doc, layout)
    return config, dict(plan(config, layout).launcher_settings.env), nproc


def _notices(config: Any, gpus: int, nproc: int, nnodes: int) -> list[str]:
    notes = []
    if gpus == 0:
        notes.append(
            f"no GPU found (nvidia-smi); running {nproc} process(es) per node on the CPU "
            "with the gloo backend (DS_ACCELERATOR=cpu)"
        )
    elif nproc > gpus:
        notes.append(f"{nproc} processes per node but only {gpus} GPU(s) visible")
    if config is not None and config.strategy == "dataparallel":
        notes.append(
            "smdistributed.dataparallel runs as plain data parallelism (torch.distributed); "
            "sagemaker_distributed_dataparallel_enabled is false so scripts do not look for SMDDP"
        )
    if config is not None and config.instance_count and config.instance_count != nnodes:
        notes.append(
            f"the estimator asks for {config.instance_count} x {config.instance_type}; "
            f"running {nnodes} node(s) x {nproc} process(es) here (config checked for this world)"
        )
    return notes


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def parse_channels(items: list[str]) -> dict[str, str]:
    """``--channel NAME=PATH`` values -> channel name -> absolute path (a malformed one is a usage error)."""
    channels: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--channel expects NAME=PATH, got {item!r}")
        channels[name] = os.path.abspath(path)
    return channels
