"""The frozen flag set of ``smp2ds``: any added, removed or renamed flag must update this snapshot.

Users script the CLI; a flag that changes by accident breaks them silently. Changing a flag is
fine when it is deliberate, and then this file changes in the same commit.
"""

from __future__ import annotations

import argparse

from smp2ds.cli import COMMANDS, build_parser

SNAPSHOT: dict[str, dict[str, object]] = {
    "smp2ds": {"options": ["--version", "-h/--help"], "positionals": ["COMMAND"]},
    "validate": {
        "options": ["--batch-size", "--format{json,text}=text", "--gpu-memory", "--model", "--seq-len", "--world-size",
                    "-h/--help"],
        "positionals": ["FILE"],
    },
    "convert": {
        "options": [
            "--batch-size",
            "--channel",
            "--checkpoint-dir",
            "--cpu",
            "--efa",
            "--format{json,text}=text",
            "--gpus-per-node",
            "--image",
            "--job-name",
            "--model-type",
            "--namespace",
            "--native",
            "--output-dir",
            "--overwrite",
            "--sbatch",
            "--to{accelerate,deepspeed,deepspeed-launcher,kubernetes,launcher,megatron,mpirun,plan,slurm,torchrun}"
            "=deepspeed",
            "--trainer",
            "--world-size",
            "-h/--help",
            "-o/--output",
        ],
        "positionals": ["FILE"],
    },
    "explain": {
        "options": [
            "--activation-checkpointing",
            "--batch-size",
            "--diagram",
            "--fit",
            "--format{json,text}=text",
            "--gpu-memory",
            "--gpus-per-node",
            "--memory",
            "--model",
            "--params",
            "--scale",
            "--schedule",
            "--seq-len",
            "--world-size",
            "-h/--help",
        ],
        "positionals": ["FILE"],
    },
    "launch": {
        "options": [
            "--channel",
            "--config",
            "--dry-run",
            "--estimator",
            "--format{json,text}=text",
            "--launcher{deepspeed,mpirun,torchrun}=deepspeed",
            "--master-addr",
            "--master-port",
            "--nnodes",
            "--node-rank",
            "--nproc-per-node",
            "--output-dir=smp2ds_output",
            "-h/--help",
        ],
        "positionals": [],
    },
    "schema": {
        "options": ["--format{json,text}=text", "--path", "--print", "--vscode", "-h/--help"],
        "positionals": [],
    },
    "doctor": {"options": ["--batch-size", "--config", "--format{json,text}=text", "--model", "--nodes/--nnodes",
                           "--seq-len", "--world-size", "-h/--help"],
               "positionals": []},
    "port": {"options": ["--batch-size", "--config", "--overwrite", "--report", "-h/--help", "-o/--output"],
             "positionals": ["SCRIPT"]},
    "checkpoint": {"options": ["-h/--help"], "positionals": ["ACTION"]},
    "checkpoint inspect": {"options": ["--format{json,text}=text", "--tag", "--tensors", "-h/--help"],
                           "positionals": ["PATH"]},
    "checkpoint consolidate": {
        "options": ["--format{pt,safetensors}=safetensors", "--out", "--quiet", "--tag", "--with-optimizer",
                    "-h/--help"],
        "positionals": ["PATH"],
    },
    "checkpoint reshard": {
        "options": ["--out", "--pp", "--quiet", "--rdp", "--sdp", "--tag", "--tp", "--world", "-h/--help"],
        "positionals": ["PATH"],
    },
    "checkpoint export": {
        "options": ["--config", "--model-type", "--names{hf,smp}=hf", "--num-attention-heads", "--quiet", "--tag",
                    "--to", "-h/--help"],
        "positionals": ["PATH"],
    },
}


def describe(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Every flag of a parser: spellings, closed choices and non-trivial defaults."""
    options, positionals = [], []
    for action in parser._actions:  # argparse has no public accessor for its actions
        if isinstance(action, argparse._SubParsersAction):
            positionals.append(action.metavar or action.dest)
            continue
        if not action.option_strings:
            positionals.append(action.metavar or action.dest)
            continue
        text = "/".join(sorted(action.option_strings, key=len))
        if action.choices:
            text += "{" + ",".join(sorted(action.choices)) + "}"
        trivial = action.default is None or action.default is False or action.default == []
        if not trivial and action.default != argparse.SUPPRESS:
            text += f"={action.default}"
        options.append(text)
    return {"options": sorted(options), "positionals": positionals}


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_subcommands_are_the_documented_eight():
    assert tuple(subparsers(build_parser())) == COMMANDS == ("validate", "convert", "explain", "launch", "schema",
                                                               "checkpoint", "doctor", "port")


def test_flag_snapshot():
    parser = build_parser()
    current = {"smp2ds": describe(parser)}
    current.update({name: describe(sub) for name, sub in subparsers(parser).items()})
    for name, sub in subparsers(parser).items():  # actions of a command (`checkpoint inspect`)
        current.update({f"{name} {action}": describe(nested) for action, nested in subparsers(sub).items()})
    assert current == SNAPSHOT
