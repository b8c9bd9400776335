"""Accelerators per SageMaker ``ml.*`` instance type: how many ranks one node runs by default.

SageMaker's MPI runner starts one process per GPU (``processes_per_host`` defaults to the GPU
count, or 1 on a CPU instance), so this table is what turns ``instance_count`` into a world size
when the distribution does not say ``processes_per_host``. Counts are the public EC2 figures.
"""

from __future__ import annotations

import re

# Exact sizes whose GPU count is not implied by their family alone.
_EXACT: dict[str, int] = {
    # P2 (K80), P3 (V100)
    "p2.xlarge": 1,
    "p2.8xlarge": 8,
    "p2.16xlarge": 16,
    "p3.2xlarge": 1,
    "p3.8xlarge": 4,
    "p3.16xlarge": 8,
    "p3dn.24xlarge": 8,
    # P4/P5 (A100/H100/H200)
    "p4d.24xlarge": 8,
    "p4de.24xlarge": 8,
    "p5.48xlarge": 8,
    "p5e.48xlarge": 8,
    "p5en.48xlarge": 8,
    # G4dn (T4): one GPU up to 16xlarge, four on 12xlarge, eight on metal
    "g4dn.xlarge": 1,
    "g4dn.2xlarge": 1,
    "g4dn.4xlarge": 1,
    "g4dn.8xlarge": 1,
    "g4dn.16xlarge": 1,
    "g4dn.12xlarge": 4,
    "g4dn.metal": 8,
    # Trainium: ranks are NeuronCores (2 per chip), which is what launchers start per node.
    "trn1.2xlarge": 2,
    "trn1.32xlarge": 32,
    "trn1n.32xlarge": 32,
}

# G5 / G6 / G6e share one size ladder: 1 GPU up to 16xlarge, 4 on 12x/24x, 8 on 48xlarge.
_G_LADDER: dict[str, int] = {
    "xlarge": 1,
    "2xlarge": 1,
    "4xlarge": 1,
    "8xlarge": 1,
    "16xlarge": 1,
    "12xlarge": 4,
    "24xlarge": 4,
    "48xlarge": 8,
}
for _family in ("g5", "g6", "g6e"):
    for _size, _gpus in _G_LADDER.items():
        _EXACT[f"{_family}.{_size}"] = _gpus

# CPU-only families: 0 GPUs, and SageMaker starts one process per host on them.
_CPU_FAMILY = re.compile(r"^(m|c|r|t|z|x)[0-9]+[a-z]*$")

_TYPE = re.compile(r"^ml\.([a-z0-9-]+)\.([a-z0-9-]+)$")


def gpus_for(instance_type: str | None) -> int | None:
    """GPUs (or NeuronCores for ``trn1``) of an ``ml.*`` instance type; 0 for CPU types.

    Returns None when the type is unknown or not an ``ml.<family>.<size>`` string, so callers
    can say "unknown" instead of guessing.
    """
    if not isinstance(instance_type, str):
        return None
    match = _TYPE.match(instance_type)
    if match is None:
        return None
    family, size = match.groups()
    key = f"{family}.{size}"
    if key in _EXACT:
        return _EXACT[key]
    if _CPU_FAMILY.match(family):
        return 0
    return None


def processes_for(instance_type: str | None) -> int | None:
    """Default processes per host for an instance type: its GPUs, or 1 on a CPU instance."""
    gpus = gpus_for(instance_type)
    if gpus is None:
        return None
    return max(gpus, 1)


def known_instance_types() -> tuple[str, ...]:
    """The accelerated instance types of the table (``ml.``-prefixed), for hints and tests."""
    return tuple(f"ml.{name}" for name in sorted(_EXACT))
