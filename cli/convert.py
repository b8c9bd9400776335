"""``smp2ds convert FILE``: DeepSpeed config, Megatron args, launchers, accelerate or the Plan of an SMP config.

``--to deepspeed`` (default) and ``--to megatron`` print JSON in both formats: the artifact *is*
JSON; in text format a one-line summary of the key fates goes to stderr so stdout stays a clean
file. ``--to launcher`` and ``--to plan`` have a text rendering for people and one JSON object
for tools (``--to plan --format json`` = ``Plan.to_dict()``). ``-o`` writes atomically and
refuses to replace an existing file unless ``--overwrite`` is given (exit 2).

``--to torchrun|deepspeed-launcher|mpirun`` prints the job's launch as a shell script (hostfile,
node and process counts, the SageMaker environment; ``launch_script``); ``--to accelerate``
needs ``-o OUT.yaml`` and writes OUT.yaml plus the DeepSpeed JSON it points at
(``accelerate_config``). ``--to slurm`` writes an sbatch script (``translator.tools.slurm``) and ``--to kubernetes`` a
Kubeflow ``PyTorchJob`` manifest (``translator.tools.kubernetes``), both starting torchrun with the same SageMaker
environment as ``--to torchrun``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from smp2ds.translator.issues import Issue, SMPConfigError
from smp2ds.translator.load import load_document
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Plan, SMPConfig
from smp2ds.translator.planner import plan
from smp2ds.translator.tools.cluster_job import cluster_job
from smp2ds.translator.tools.kubernetes import check_job_name, pytorchjob, render_manifest
from smp2ds.translator.tools.kubernetes import job_name as k8s_name
from smp2ds.translator.tools.launch_script import launch_spec, render_launch_script
from smp2ds.translator.tools.sagemaker_paths import map_paths
from smp2ds.translator.tools.slurm import check_sbatch_options, job_name, render_sbatch, slurm_spec
from smp2ds.translator.tools.trainer_deepspeed import trainer_config

from . import (
    EXIT_OK,
    UsageError,
    add_file_arg,
    add_format_arg,
    add_layout_args,
    command_parser,
    layout_from_args,
    report,
    source_name,
    write_stdout,
)
from .accelerate_config import deepspeed_json_path, fsdp2_sizes, render_accelerate_yaml, render_fsdp2_yaml
from .launch import parse_channels

TARGETS: tuple[str, ...] = (
    "deepspeed",
    "megatron",
    "launcher",
    "plan",
    "accelerate",
    "torchrun",
    "deepspeed-launcher",
    "mpirun",
    "slurm",
    "kubernetes",
)
LAUNCH_TARGETS = ("torchrun", "deepspeed-launcher", "mpirun")
CLUSTER_TARGETS = ("slurm", "kubernetes")
PATH_TARGETS = LAUNCH_TARGETS + CLUSTER_TARGETS


def convert_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``convert`` (or build a standalone parser when ``subparsers`` is None)."""
    description = (
        "Translate an SMP configuration into a DeepSpeed config, Megatron arguments, launcher commands, "
        "an accelerate config or the whole plan. --to torchrun / deepspeed-launcher / mpirun print the "
        "job's launch as a shell script; --to accelerate -o OUT.yaml also writes OUT.deepspeed.json; --to slurm "
        "prints an sbatch script and --to kubernetes a Kubeflow PyTorchJob manifest."
    )
    parser = command_parser(subparsers, "convert", description)
    add_file_arg(parser)
    add_layout_args(parser)
    parser.add_argument("--to", choices=TARGETS, default="deepspeed", help="what to produce (default: deepspeed)")
    parser.add_argument("-o", "--output", metavar="OUT", help="write to OUT instead of standard output")
    parser.add_argument("--overwrite", action="store_true", help="allow -o to replace an existing file")
    paths = parser.add_argument_group(
        "SageMaker's paths, for --to torchrun / deepspeed-launcher / mpirun / slurm / kubernetes")
    paths.add_argument("--output-dir", metavar="DIR",
                       help="where /opt/ml/model (SM_MODEL_DIR: DIR/model) and /opt/ml/output go")
    paths.add_argument("--checkpoint-dir", metavar="DIR", help="where /opt/ml/checkpoints goes")
    paths.add_argument("--channel", action="append", default=[], metavar="NAME=PATH",
                       help="an input channel: SM_CHANNEL_<NAME>=PATH, and /opt/ml/input/data/NAME -> PATH "
                       "(repeatable)")
    cluster = parser.add_argument_group("clusters, for --to slurm / kubernetes")
    cluster.add_argument("--job-name", metavar="NAME",
                         help="the Slurm job's or PyTorchJob's name (default: smp2ds-<FILE's name>)")
    cluster.add_argument("--cpu", action="store_true",
                         help="run the ranks on CPUs (DS_ACCELERATOR=cpu): request no GPUs")
    cluster.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                         help="--to slurm: one more #SBATCH option, written as --sbatch=--partition=gpu (repeatable)")
    cluster.add_argument("--image", metavar="IMAGE",
                         help="--to kubernetes (required): the container image with the script, smp2ds and torch")
    cluster.add_argument("--namespace", metavar="NS", help="--to kubernetes: the PyTorchJob's namespace")
    cluster.add_argument("--efa", action="store_true",
                         help="keep the estimator's EFA variables (FI_*, RDMAV_FORK_SAFE) for a cluster on AWS, and "
                         "request EFA interfaces per pod (default: left out, and the file says so)")
    native = parser.add_argument_group("leaving SMP, for --to deepspeed")
    native.add_argument("--native", action="store_true",
                        help="a config for a plain deepspeed.initialize script at the job's layout (micro-batches as "
                        "gradient accumulation, MiCS as ZeRO-3 with hpZ, tensor parallelism as AutoTP), each "
                        "difference from SMP printed; needs the per-rank batch (--batch-size or the hyperparameters)")
    native.add_argument("--model-type", metavar="TYPE",
                        help="with --native: the model's Hugging Face model_type (e.g. llama, gpt2), to refuse "
                        "tensor parallelism for a family DeepSpeed's AutoTP refuses")
    parser.add_argument("--trainer", action="store_true",
                        help="with --to accelerate or --to deepspeed --native: the DeepSpeed JSON for a Hugging Face "
                        "Trainer script: batch sizes, gradient accumulation and clipping \"auto\" (the Trainer "
                        "fills them from its TrainingArguments and refuses a JSON that differs from them)")
    add_format_arg(parser)
    parser.set_defaults(handler=convert_command)
    return parser


def convert_command(args: argparse.Namespace) -> int:
    """Run ``convert``; returns 0, or raises for the guard in ``cli.run_guarded`` to report."""
    if args.overwrite and not args.output:
        raise UsageError("--overwrite only makes sense with -o/--output")
    if args.to == "accelerate" and not args.output:
        raise UsageError("--to accelerate writes two files (OUT and the DeepSpeed JSON it names); give -o OUT.yaml")
    for path in _outputs(args):
        if os.path.exists(path) and not args.overwrite:
            raise UsageError(f"{path} exists; pass --overwrite to replace it")
    mapping = bool(args.output_dir or args.checkpoint_dir or args.channel)
    if mapping and args.to not in PATH_TARGETS:
        raise UsageError(f"--output-dir, --checkpoint-dir and --channel map SageMaker's paths in a launch script; "
                         f"use them with --to {' / '.join(PATH_TARGETS)}, not --to {args.to}")
    _check_cluster_flags(args)
    if (args.native or args.model_type) and args.to != "deepspeed":
        raise UsageError(f"--native / --model-type write a native DeepSpeed config: use them with --to deepspeed, "
                         f"not --to {args.to}")
    if args.model_type and not args.native:
        raise UsageError("--model-type is for --native (the AutoTP family check)")
    if args.trainer and not (args.to == "accelerate" or args.native):
        raise UsageError(f"--trainer shapes the DeepSpeed JSON of --to accelerate or --to deepspeed --native, not "
                         f"--to {args.to}" + ("" if args.to != "deepspeed" else " without --native"))


    layout = layout_from_args(args)
    document = load_document(args.file)
    config = normalize(document, layout)
    result = plan(config, layout)
    if args.to == "accelerate":
        return _write_accelerate(result, args)
    if args.native:
        return _write_native(result, args)
    if args.to in LAUNCH_TARGETS:
        text = render_launch(result, args.to, args.format, _entry_point(document), config, _local_paths(args))
    elif args.to in CLUSTER_TARGETS:
        text = render_cluster(result, args, _entry_point(document), config, _source_dir(document))
    else:
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


def _check_cluster_flags(args: argparse.Namespace) -> None:
    """The cluster flags only with the targets they shape; --to kubernetes needs --image."""
    given = [flag for flag, value, targets in (
        ("--job-name", args.job_name, CLUSTER_TARGETS), ("--cpu", args.cpu, CLUSTER_TARGETS),
        ("--sbatch", args.sbatch, ("slurm",)), ("--image", args.image, ("kubernetes",)),
        ("--namespace", args.namespace, ("kubernetes",))) if value and args.to not in targets]
    if given:
        allowed = "slurm" if given[0] == "--sbatch" else "kubernetes" if given[0] in ("--image", "--namespace") \
            else "slurm / kubernetes"
        raise UsageError(f"{given[0]} only applies to --to {allowed}, not --to {args.to}")
    if args.to == "kubernetes" and not (args.image or "").strip():
        raise UsageError("--to kubernetes needs --image IMAGE: the container image that holds the training script, "
                         "smp2ds and torch")
    if args.to == "slurm":
        try:
            args.sbatch = check_sbatch_options(args.sbatch)
        except ValueError as err:
            raise UsageError(str(err)) from None
    if args.job_name is not None and args.to == "kubernetes":
        try:
            check_job_name(args.job_name)
        except ValueError as err:
            raise UsageError(str(err)) from None
    elif args.job_name is not None and not args.job_name.strip():
        raise UsageError("--job-name must not be empty")


def render_cluster(result: Plan, args: argparse.Namespace, entry_point: str | None, config: SMPConfig,
                   source_dir: str | None = None) -> str:
    """``--to slurm``: the sbatch script (``--format json``: its parts); ``--to kubernetes``: the PyTorchJob, as
    YAML, or JSON with ``--format json``, ``-o FILE.json`` or without PyYAML."""

    ddp_port = config.given.get("ddp_port")
    ddp_port = ddp_port if isinstance(ddp_port, int) and not isinstance(ddp_port, bool) else None
    job = cluster_job(result.launcher_settings, entry_point, _local_paths(args), ddp_port,
                      source_dir=source_dir, efa=args.efa)
    job["instance_type"] = config.instance_type
    instance = f"{config.instance_count} x {config.instance_type}" if config.instance_type else None
    if args.to == "slurm":
        options = {"name": args.job_name or job_name(source_name(args.file)), "gpus": not args.cpu,
                   "extra": args.sbatch, "instance": instance}
        return report.dump_json(slurm_spec(job, **options)) if args.format == "json" else render_sbatch(job, **options)

    manifest = pytorchjob(job, name=args.job_name or k8s_name(source_name(args.file)), image=args.image.strip(),
                          gpus=not args.cpu, namespace=args.namespace)
    as_json = args.format == "json" or (args.output or "").lower().endswith(".json")
    return render_manifest(manifest, "json" if as_json else "auto")


def _outputs(args: argparse.Namespace) -> list[str]:
    """The files this run writes (none without -o)."""
    if not args.output:
        return []
    if args.to == "accelerate":
        return [args.output, deepspeed_json_path(args.output)]
    return [args.output]


def _source_dir(document: Any) -> str | None:
    """The estimator's ``source_dir`` (the folder SageMaker ran the entry point from), when it names one."""
    value = document.get("source_dir") if isinstance(document, dict) else None
    return value if isinstance(value, str) and value else None


def _entry_point(document: Any) -> str | None:
    """The estimator's ``entry_point`` (the script SageMaker runs), when the input names one."""
    value = document.get("entry_point") if isinstance(document, dict) else None
    return value if isinstance(value, str) and value else None


def _write_accelerate(result: Plan, args: argparse.Namespace) -> int:
    _refuse_model_parallel_for_accelerate(result)
    if fsdp2_sizes(result) is not None:  # sharded data or tensor parallelism: FSDP2's mesh, no DeepSpeed JSON
        write_atomically(args.output, render_fsdp2_yaml(result, source_name(args.file)))
        if args.format == "json":
            write_stdout(report.dump_json({"accelerate_config": args.output}))
        else:
            sys.stderr.write(f"smp2ds convert: wrote accelerate config {args.output} (FSDP2, ParallelismConfig)\n")
            if args.trainer:
                sys.stderr.write("smp2ds convert: FSDP2 needs no DeepSpeed JSON: the Trainer takes batch sizes, "
                                 "accumulation and clipping from its TrainingArguments as they are\n")
        return EXIT_OK
    ds_path = deepspeed_json_path(args.output)
    config, notes = trainer_config(result.deepspeed) if args.trainer else (result.deepspeed, [])
    write_atomically(ds_path, report.dump_json(config))
    write_atomically(args.output, render_accelerate_yaml(result, ds_path, source_name(args.file)))
    if args.format == "json":
        write_stdout(report.dump_json({"accelerate_config": args.output, "deepspeed_config": ds_path}))
    else:
        sys.stderr.write(f"smp2ds convert: wrote accelerate config {args.output} -> DeepSpeed config {ds_path}\n")
        for note in notes:
            sys.stderr.write(f"smp2ds convert: {note}\n")
    return EXIT_OK


def _write_native(result: Plan, args: argparse.Namespace) -> int:
    """``--to deepspeed --native``: the plain-DeepSpeed config, then (text format) what differs from SMP."""
    # CLI start-up: the native config's rules load only for --native
    from smp2ds.translator.tools.native_deepspeed import native_config


    config, notes = native_config(result, args.model_type, batch_from_trainer=args.trainer)
    if args.trainer:
        config, trainer_notes = trainer_config(config)
        notes = [*notes, *trainer_notes]
    text = report.dump_json({"deepspeed": config, "differences": notes} if args.format == "json" else config)
    if args.output:
        write_atomically(args.output, text)
        sys.stderr.write(f"smp2ds convert: wrote a native DeepSpeed config to {args.output}\n")
    else:
        write_stdout(text)
    if args.format == "text":
        for note in notes:
            sys.stderr.write(f"smp2ds convert: differs from SMP: {note}\n")
    return EXIT_OK


def _refuse_model_parallel_for_accelerate(result: Plan) -> None:
    """accelerate has no pipeline engine for an arbitrary model (its FSDP2 mesh takes data, shard, tensor and
    context parallelism): a plan with pipeline parallelism is refused with the routes that work."""

    stages = result.topology_settings.pipeline_parallel_degree
    if stages > 1:
        raise SMPConfigError([Issue(
            "/pipeline_parallel_degree", f"pipeline_parallel_degree {stages} cannot be carried to accelerate: "
            "its ParallelismConfig has data, shard, tensor and context dimensions, no pipeline stages",
            hint="run the script unchanged with smp2ds launch (or convert --to torchrun / deepspeed-launcher), or "
                 "leave pipelines: `smp2ds checkpoint export --to hf` and train that model under accelerate with "
                 "data, sharded data or tensor parallelism")])


def _local_paths(args: argparse.Namespace) -> dict[str, Any]:
    """The folders SageMaker's paths map to (absolute), from --output-dir, --checkpoint-dir and --channel."""

    return {"output_dir": args.output_dir and os.path.abspath(args.output_dir),
            "checkpoint_dir": args.checkpoint_dir and os.path.abspath(args.checkpoint_dir),
            "channels": parse_channels(args.channel)}


def render_launch(result: Plan, target: str, fmt: str, entry_point: str | None, config: SMPConfig,
                  paths: dict[str, Any] | None = None) -> str:
    """``--to torchrun|deepspeed-launcher|mpirun``: a shell script, or its parts as one JSON object."""

    spec = launch_spec(result.launcher_settings, target, entry_point)
    if paths and (paths["output_dir"] or paths["checkpoint_dir"] or paths["channels"]):
        spec["env"], spec["command"] = map_paths(spec["env"], spec["command"], **paths)
    if fmt == "json":
        return report.dump_json(spec)
    instance = f"{config.instance_count} x {config.instance_type}" if config.instance_type else None
    return render_launch_script(spec, instance)


def render(result: Plan, target: str, fmt: str) -> str:
    """The text ``convert`` prints for ``--to target --format fmt``."""

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
