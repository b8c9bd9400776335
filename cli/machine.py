"""What this machine offers a launch: GPUs, a free port, the launcher programs beside this Python.

The probes ``smp2ds launch`` makes before building its environment and command line with
``smp2ds.translator.launcher`` (which probes nothing itself). None of them imports torch.
"""

from __future__ import annotations

import os
import sys

from smp2ds.translator.issues import InputError
from smp2ds.translator.tools.device_memory import MIB, device_bytes

_LAUNCHER_MODULES = {"deepspeed": "deepspeed.launcher.runner", "torchrun": "torch.distributed.run"}


def detect_gpus() -> int:
    """GPUs this process may use, without importing torch.

    ``SMP2DS_NUM_GPUS`` overrides; otherwise ``nvidia-smi --list-gpus`` (as the SageMaker toolkit
    counts them), narrowed by ``CUDA_VISIBLE_DEVICES``; no ``nvidia-smi`` means no GPU.
    """
    forced = os.environ.get("SMP2DS_NUM_GPUS")
    if forced is not None and forced.strip() != "":
        if not forced.strip().isdigit():

            raise InputError(f"environment variable SMP2DS_NUM_GPUS={forced!r} is not a GPU count; "
                             "allowed: a whole number >= 0, or unset to ask nvidia-smi")
        return int(forced)
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "--list-gpus"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        count = min(count, len(ids))
    return count


def detect_gpu_memory() -> tuple[int, str] | None:
    """(bytes, label) of the first visible GPU's memory, without importing torch; None without a GPU.

    ``SMP2DS_GPU_MEMORY`` overrides (a size such as ``80GiB`` or a GPU name, for a dry run on a login node);
    otherwise ``nvidia-smi --query-gpu=memory.total`` of the first device ``CUDA_VISIBLE_DEVICES`` lets us see.
    """

    forced = os.environ.get("SMP2DS_GPU_MEMORY", "").strip()
    if forced:
        try:
            size, label = device_bytes(forced)
        except ValueError as err:

            raise InputError(f"environment variable SMP2DS_GPU_MEMORY={forced!r}: {err}") from None
        return size, f"{label} (SMP2DS_GPU_MEMORY)"
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None or detect_gpus() == 0:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sizes = [int(line.strip()) for line in out.stdout.splitlines() if line.strip().isdigit()]
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip().isdigit()]
    index = int(visible[0]) if visible else 0
    if index >= len(sizes):
        return None
    return sizes[index] * MIB, f"GPU {index} ({sizes[index]} MiB, nvidia-smi)"


def free_port() -> int:
    """A TCP port that is free on this host right now (one node only: no shared port needed)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launcher_program(launcher: str) -> list[str]:
    """How to start ``launcher`` here: deepspeed and torchrun next to this interpreter (never one
    from another Python found on PATH, else ``python -m`` their module); mpirun from PATH."""
    if launcher not in _LAUNCHER_MODULES:
        import shutil

        return [shutil.which(launcher) or launcher]
    beside = os.path.join(os.path.dirname(sys.executable), launcher)
    return [beside] if os.access(beside, os.X_OK) else [sys.executable, "-m", _LAUNCHER_MODULES[launcher]]
