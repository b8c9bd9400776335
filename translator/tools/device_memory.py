"""Device memory sizes for ``--gpu-memory`` / ``--fit``: a size (``80GiB``, ``40GB``) or a GPU's name.

Named GPUs give the total memory ``nvidia-smi`` lists for them (MiB), which is what the CUDA context and
the caching allocator share; SageMaker instance families name the GPU they carry.
"""

from __future__ import annotations

import re

MIB = 1 << 20
GPUS_MIB: dict[str, int] = {
    "t4": 15360,
    "v100-16gb": 16160,
    "v100-32gb": 32510,
    "a10g": 23028,
    "l4": 23034,
    "l40s": 46068,
    "a100-40gb": 40960,
    "a100-80gb": 81920,
    "h100": 81559,
    "h200": 143771,
}
ALIASES: dict[str, str] = {"v100": "v100-16gb", "a100": "a100-40gb", "h100-80gb": "h100", "h200-141gb": "h200"}
INSTANCE_GPUS: dict[str, str] = {
    "g4dn": "t4", "p3": "v100-16gb", "p3dn": "v100-32gb", "g5": "a10g", "g6": "l4", "g6e": "l40s",
    "p4d": "a100-40gb", "p4de": "a100-80gb", "p5": "h100", "p5e": "h200", "p5en": "h200",
}
_UNITS = {"": 1 << 30, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": MIB, "mib": MIB, "mb": 1000**2,
          "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3, "t": 1 << 40, "tib": 1 << 40, "tb": 1000**4}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def device_bytes(text: str) -> tuple[int, str]:
    """(bytes, how it was read) for a size, a GPU name or an ``ml.`` instance type; ValueError otherwise.

    A bare number is GiB; ``GB`` is 10^9 bytes and ``GiB`` 2^30.
    """
    name = text.strip().lower()
    match = _SIZE.match(name)
    if match and match.group(2) in _UNITS:
        return int(float(match.group(1)) * _UNITS[match.group(2)]), text.strip()
    if name.startswith("ml."):
        family = name[3:].split(".")[0]
        if family in INSTANCE_GPUS:
            gpu = INSTANCE_GPUS[family]
            return GPUS_MIB[gpu] * MIB, f"{text.strip()} ({gpu}, {GPUS_MIB[gpu]} MiB)"
    gpu = ALIASES.get(name, name)
    if gpu in GPUS_MIB:
        return GPUS_MIB[gpu] * MIB, f"{gpu} ({GPUS_MIB[gpu]} MiB)"
    known = ", ".join(sorted(GPUS_MIB) + sorted(ALIASES))
    raise ValueError(f"{text!r} is neither a size (80GiB, 40GB, 24) nor a known GPU ({known}) or ml. instance type "
                     f"of the families {', '.join(sorted(INSTANCE_GPUS))}")
