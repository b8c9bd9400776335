"""The checks of ``smp2ds doctor``, as pure functions of the facts ``smp2ds.cli.doctor`` reads.

Each check returns `Finding` s: ``ok``, ``info``, ``warn`` (works, but worth knowing) or
``problem`` (the job will not run as asked; ``fix`` says what to do). Nothing here imports torch
or DeepSpeed or probes the machine, so every rule can be tested on any machine with the facts
of another.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "info", "warn", "problem"]


@dataclass(frozen=True)
class Finding:
    """One line of the report: what was checked, what was found and, for a problem, the fix."""

    check: str
    status: Status
    detail: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Tested:
    """The releases of a dependency the test suite runs: ``floor`` (refused below) to ``newest``."""

    floor: str
    newest: str
    required: bool = True
    """False for extras (accelerate: only the Hugging Face Trainer path needs it)."""
    tested_from: str | None = None
    """The oldest release the suite runs when it is above ``floor`` (installable, warned below this)."""

    @property
    def oldest_tested(self) -> str:
        return self.tested_from or self.floor


TESTED: dict[str, Tested] = {
    # Floors are pyproject.toml's (the dependency job .ci/floor runs exactly them); newest is what the
    # main suite ran on. A newer release is a warning, not a problem: it usually works.
    # torch installs from 2.1 (pip must not replace a GPU build), but only the 2.13 CPU build is tested here.
    "torch": Tested("2.1", "2.13.0", tested_from="2.13.0"),
    "deepspeed": Tested("0.19.7", "0.19.8"),
    "transformers": Tested("4.41.0", "5.24.0"),
    "accelerate": Tested("1.3", "1.15.0", required=False),
}


def version_tuple(text: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13, 0)``; release candidates count as their release."""
    parts = []
    for piece in re.split(r"[.+-]", text)[:3]:
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts + [0] * (3 - len(parts)))


def check_versions(installed: Mapping[str, str | None], tested: Mapping[str, Tested] = TESTED) -> list[Finding]:
    """Each dependency's installed version against the releases we test."""
    out = []
    for name, rng in tested.items():
        have = installed.get(name)
        pin = f'pip install "{name}>={rng.floor}"'
        if have is None:
            status: Status = "problem" if rng.required else "info"
            why = "" if rng.required else " (only the Hugging Face Trainer path needs it)"
            out.append(Finding(name, status, f"not installed{why}", pin if rng.required else ""))
        elif version_tuple(have) < version_tuple(rng.floor):
            out.append(Finding(name, "problem", f"{have} is older than {rng.floor}, the oldest release we support "
                               f"(tested {rng.oldest_tested} .. {rng.newest})",
                               pin))
        elif version_tuple(have) < version_tuple(rng.oldest_tested):
            out.append(Finding(name, "warn", f"{have} installs (from {rng.floor}) but is older than "
                               f"{rng.oldest_tested}, the oldest release we test (tested {rng.oldest_tested} .. "
                               f"{rng.newest})"))
        elif version_tuple(have) > version_tuple(rng.newest):
            out.append(Finding(name, "warn", f"{have} is newer than {rng.newest}, the newest release we test "
                               f"(tested {rng.oldest_tested} .. {rng.newest})"))
        else:
            out.append(Finding(name, "ok", f"{have} (tested {rng.oldest_tested} .. {rng.newest})"))
    return out


@dataclass(frozen=True)
class Machine:
    """What the collector found about devices and tools."""

    gpus: int
    torch_cuda: bool
    """torch is a CUDA build (its libtorch_cuda library is present)."""
    nccl: bool
    cpus: int
    mpirun: str | None
    compiler: str | None
    ds_ops: Mapping[str, bool] = field(default_factory=dict)
    """DeepSpeed op name -> usable without a build (prebuilt at install, or in the JIT cache)."""


def check_devices(m: Machine) -> list[Finding]:
    """CUDA / NCCL and the GPU count, or CPU with gloo."""
    if m.gpus == 0:
        return [Finding("devices", "info", f"no GPU visible: ranks run on the CPU ({m.cpus} cores) with gloo; "
                        "smp2ds launch sets DS_ACCELERATOR=cpu (set it yourself under torchrun or deepspeed)")]
    out = [Finding("devices", "ok", f"{m.gpus} GPU(s) visible")]
    if not m.torch_cuda:
        out.append(Finding("cuda", "problem", f"{m.gpus} GPU(s) visible but torch is a CPU-only build",
                           "install a CUDA build of torch (https://pytorch.org/get-started/locally/)"))
    elif not m.nccl:
        out.append(Finding("nccl", "problem", "torch is a CUDA build but no NCCL library was found",
                           "install torch from the PyTorch wheels (they bundle NCCL) or pip install nvidia-nccl-cu12"))
    else:
        out.append(Finding("nccl", "ok", "CUDA build of torch with NCCL"))
    return out


def check_ops(m: Machine, needs: Mapping[str, str]) -> list[Finding]:
    """DeepSpeed ops ``needs`` (op name -> why) against what is built; a missing op is JIT-compiled."""
    out = []
    for op, why in needs.items():
        if m.ds_ops.get(op):
            out.append(Finding(f"op {op}", "ok", f"built ({why})"))
        elif m.compiler is None:
            out.append(Finding(f"op {op}", "problem", f"not built and no C++ compiler to build it ({why})",
                               "install a C++ compiler (apt-get install g++), or DeepSpeed with the op prebuilt "
                               f"(DS_BUILD_{op.upper()}=1 pip install deepspeed)"))
        else:
            out.append(Finding(f"op {op}", "warn", f"not built yet: DeepSpeed compiles it on first use, which takes "
                               f"about a minute per rank-0 start ({why})",
                               f"prebuild it once: python -c \"from deepspeed.accelerator import get_accelerator; "
                               f"get_accelerator().create_op_builder('{OP_BUILDERS[op]}').load()\""))
    return out


OP_BUILDERS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "fused_adam": "FusedAdamBuilder",
               "cpu_adam": "CPUAdamBuilder"}


def ops_needed(m: Machine, deepspeed_config: Mapping[str, Any] | None) -> dict[str, str]:
    """The ops a run needs here: the CPU comm op on CPU; Adam's kernels where the config asks for them."""
    needs = {}
    if m.gpus == 0:
        needs["deepspeed_shm_comm"] = "DeepSpeed's CPU collectives"
    cfg = deepspeed_config or {}
    optimizer = str((cfg.get("optimizer") or {}).get("type", "")).lower()
    zero = cfg.get("zero_optimization") or {}
    offload = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
    if optimizer in ("adam", "adamw") and offload in ("cpu", "nvme"):
        needs["cpu_adam"] = "the config offloads Adam's state to the CPU"
    elif optimizer in ("adam", "adamw") and m.gpus > 0:
        needs["fused_adam"] = "the config asks DeepSpeed for Adam on GPU"
    return needs


def check_mpi(m: Machine) -> list[Finding]:
    if m.mpirun:
        return [Finding("mpirun", "ok", m.mpirun)]
    return [Finding("mpirun", "info", "not found: only `smp2ds launch --launcher mpirun` (SageMaker's MPI way) needs "
                    "it; torchrun and deepspeed do not")]


def check_launch_env(env: Mapping[str, str]) -> list[Finding]:
    """The launch variables of this shell, as smp2ds reads them at ``smp.init``."""
    out = []
    ints = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        if name in env:
            try:
                ints[name] = int(env[name])
            except ValueError:
                out.append(Finding("launch env", "problem", f"{name}={env[name]!r} is not a whole number",
                                   f"unset {name} or set it to a number"))
    if ("RANK" in env) != ("WORLD_SIZE" in env):
        have, miss = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        out.append(Finding("launch env", "problem", f"{have} is set but {miss} is not",
                           f"unset {have} (a plain `python train.py` is one process), or start the script with "
                           "smp2ds launch, torchrun or deepspeed, which set both"))
    elif "RANK" in ints and "WORLD_SIZE" in ints and not 0 <= ints["RANK"] < ints["WORLD_SIZE"]:
        out.append(Finding("launch env", "problem", f"RANK={ints['RANK']} is outside WORLD_SIZE={ints['WORLD_SIZE']}",
                           "RANK must be 0 .. WORLD_SIZE-1; let the launcher set both"))
    local = ints.get("LOCAL_WORLD_SIZE", ints.get("LOCAL_SIZE"))
    if local is not None and "WORLD_SIZE" in ints and (local < 1 or ints["WORLD_SIZE"] % local):
        out.append(Finding("launch env", "problem", f"ranks per node {local} (LOCAL_SIZE / LOCAL_WORLD_SIZE) does not "
                           f"divide WORLD_SIZE={ints['WORLD_SIZE']}", "let the launcher set the local size"))
    if "RANK" in env and "WORLD_SIZE" in env and ints.get("WORLD_SIZE", 1) > 1 and "MASTER_ADDR" not in env:
        out.append(Finding("launch env", "warn", "RANK/WORLD_SIZE are set without MASTER_ADDR/MASTER_PORT: smp.init "
                           "cannot meet the other ranks", "export MASTER_ADDR and MASTER_PORT, or use a launcher"))
    if not out and any(k in env for k in ("RANK", "WORLD_SIZE")):
        out.append(Finding("launch env", "ok", f"rank {env['RANK']} of {env['WORLD_SIZE']}"))
    elif not out:
        out.append(Finding("launch env", "info", "no RANK/WORLD_SIZE: a plain run is one process"))
    return out


def parse_mp_parameters(text: str) -> tuple[Any, list[Finding]]:
    """``SM_HP_MP_PARAMETERS``: SageMaker passes the estimator's SMP parameters as a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, [Finding("SM_HP_MP_PARAMETERS", "problem", f"not JSON ({err.msg} at character {err.pos})",
                              "set it to a JSON object of SMP parameters, e.g. '{\"partitions\": 2}', or unset it")]
    if not isinstance(value, dict):
        return None, [Finding("SM_HP_MP_PARAMETERS", "problem", f"a JSON {type(value).__name__}, not an object",
                              "set it to a JSON object of SMP parameters, or unset it")]
    return value, []


def check_layout(world: int, per_node: int, m: Machine, nodes: int) -> list[Finding]:
    """Whether ``world`` ranks, ``per_node`` of them on each node, fit ``nodes`` nodes like this one.

    SMP refused more processes on a node than visible GPUs; on CPU more ranks than cores only run slowly.
    """
    if m.gpus == 0:
        if per_node > m.cpus:
            return [Finding("layout", "warn", f"{per_node} CPU ranks per node on {m.cpus} core(s): gloo runs them, "
                            "slowly", "fewer ranks, or a GPU machine")]
        return [Finding("layout", "ok", f"{world} CPU rank(s), {per_node} per node")]
    need = -(-world // m.gpus)
    if per_node > m.gpus or need > nodes:
        return [Finding("layout", "problem", f"the configuration runs {world} ranks ({per_node} per node) but "
                        f"{nodes} node(s) with {m.gpus} visible GPU(s) each hold only {m.gpus * nodes}",
                        f"run {m.gpus} ranks per node on {need} nodes (--nodes {need}), or lower the degrees "
                        "(smp2ds explain shows the layout)")]
    return [Finding("layout", "ok", f"{world} ranks, {per_node} per node on {nodes} node(s) of {m.gpus} GPU(s)")]


def exit_code(findings: list[Finding]) -> int:
    """0 when nothing is a problem, else 1."""
    return 1 if any(f.status == "problem" for f in findings) else 0
