"""``smp2ds convert --to torchrun|deepspeed-launcher|mpirun``: the launch of an estimator's job as a shell script.

The command lines, the hostfile and the SageMaker environment come from the plan's ``launcher``
section (``smp2ds.translator.launcher``); this module only arranges them into what a person runs:
the ``export`` lines, the files the launcher reads, and the one command, with a comment saying
where to run it (torchrun: on every node with its ``NODE_RANK``; deepspeed and mpirun: once, on
the first host, which reaches the others over ssh).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from smp2ds.translator.launcher import deepspeed_env_text, shell_name
from smp2ds.translator.plan_types import LauncherSettings

LAUNCH_TARGETS: dict[str, str] = {
    "torchrun": "torchrun",
    "deepspeed-launcher": "deepspeed",
    "mpirun": "mpirun",
}
"""``convert --to`` target -> key of the plan's launcher section. (``--to deepspeed`` already
names the DeepSpeed JSON config, so the deepspeed launcher's target says so in full.)"""

NODE_RANK = "${NODE_RANK}"


def launch_spec(launcher: LauncherSettings, target: str, entry_point: str | None = None) -> dict[str, Any]:
    """What ``--to target --format json`` prints: the command (argv), env, files and where to run it."""
    key = LAUNCH_TARGETS[target]
    nodes = launcher.nodes
    command = _with_entry_point(list(launcher.command(key)), launcher.script, entry_point)
    if nodes == 1:  # one node: its rank is 0, no variable to set
        command = ["0" if arg == NODE_RANK else arg for arg in command]
    env = dict(launcher.env)
    files: dict[str, str] = {}
    if key == "deepspeed" and nodes > 1:
        files = {"hostfile": launcher.hostfile, ".deepspeed_env": deepspeed_env_text(env)}
    return {
        "launcher": key,
        "nodes": nodes,
        "nproc_per_node": launcher.ranks_per_node,
        "world_size": launcher.world_size,
        "hosts": list(launcher.hosts),
        "run_on": "every node, NODE_RANK=0..N-1 (0 on the first host)"
        if key == "torchrun" and nodes > 1
        else "the first host",
        "command": command,
        "env": env,
        "files": files,
    }


def render_launch_script(spec: Mapping[str, Any], instance: str | None = None) -> str:
    """The spec as a POSIX shell script: comments, files written by here-documents, exports, command."""
    hosts = spec["hosts"]
    span = hosts[0] if len(hosts) == 1 else f"{hosts[0]} .. {hosts[-1]}"
    lines = [
        "#!/bin/sh",
        f"# {spec['launcher']}: {spec['nodes']} node(s) x {spec['nproc_per_node']} process(es) per node = "
        f"{spec['world_size']} ranks" + (f" ({instance})" if instance else ""),
        f"# hosts {span}: SageMaker's host names; map them to your machines (/etc/hosts) or edit them below",
        f"# MASTER_ADDR: the first node's address (default {hosts[0]})",
    ]
    if spec["launcher"] == "torchrun" and spec["nodes"] > 1:
        lines.append(f"# run on every node with NODE_RANK set to its index (0 on {hosts[0]}, the master)")
    elif spec["nodes"] > 1:
        lines.append(f"# run once, on {hosts[0]}: the launcher starts the other nodes over ssh")
    if spec["launcher"] == "deepspeed" and spec["files"]:
        lines.append("# .deepspeed_env carries the SageMaker variables to the other nodes")
    if spec["launcher"] != "torchrun" and spec["nodes"] > 1:
        lines.append(f"# SM_CURRENT_HOST is {hosts[0]} on every node; set it per host if your script reads it")
    lines.append("set -e")
    for name, text in spec["files"].items():
        lines.append(f"cat > {name} <<'SMP2DS_EOF'")
        lines.extend(text.splitlines())
        lines.append("SMP2DS_EOF")
    passed: list[str] = []  # names a shell cannot export (SM_HP_CHECKPOINT-DIR): given to the command by env
    for name, value in spec["env"].items():
        if name == "SM_CURRENT_HOST" and spec["launcher"] == "torchrun" and spec["nodes"] > 1:
            lines.append('export SM_CURRENT_HOST="algo-$((NODE_RANK + 1))"')  # this node's SageMaker name
        elif shell_name(name):
            lines.append(f"export {name}={shlex.quote(str(value))}")
        else:
            passed.append(shlex.quote(f"{name}={value}"))
    if passed and spec["launcher"] == "deepspeed" and spec["nodes"] > 1:
        lines.append("# the env-passed names below reach this node only: DeepSpeed cannot export them to the others")
    prefix = f"env {' '.join(passed)} " if passed else ""
    lines.append(prefix + shell_command(spec["command"]))
    return "\n".join(lines) + "\n"


_MASTER_FLAGS = ("--master-addr", "--master_addr")


def shell_command(argv: Sequence[str]) -> str:
    """``argv`` quoted for the shell, except ``${NODE_RANK}``, which the shell must expand, and the master
    address, which ``$MASTER_ADDR`` overrides (SageMaker's first host name is only the default)."""
    words = []
    for i, arg in enumerate(argv):
        before = argv[i - 1] if i else ""
        if arg == NODE_RANK:
            words.append('"${NODE_RANK}"')
        elif before in _MASTER_FLAGS:
            words.append(f'"${{MASTER_ADDR:-{arg}}}"')
        elif before == "-x" and arg.startswith("MASTER_ADDR="):
            words.append(f'"MASTER_ADDR=${{MASTER_ADDR:-{arg.partition("=")[2]}}}"')
        else:
            words.append(shlex.quote(arg))
    return " ".join(words)


def _with_entry_point(command: list[str], placeholder: str, entry_point: str | None) -> list[str]:
    """The command with the plan's script placeholder replaced by the estimator's entry point."""
    if entry_point and placeholder in command:
        command[command.index(placeholder)] = entry_point
    return command
