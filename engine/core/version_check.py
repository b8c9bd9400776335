"""Refuse a DeepSpeed older than the plans target, before anything depends on it.

An old DeepSpeed otherwise fails much later, inside ``deepspeed.initialize`` or on a private name the
engine relies on, with an error that does not say the version is the cause. The installed version is
read from the package metadata (what pip installed), so the check does not import DeepSpeed.
"""

from __future__ import annotations

import re
from importlib import metadata

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.translator.ds_compat import MIN_DEEPSPEED


def installed_deepspeed() -> str | None:
    """The installed DeepSpeed version string, or None when DeepSpeed is not installed."""
    try:
        return metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...] | None:
    """The numeric release part (``0.19.8+cpu`` -> (0, 19, 8)); None when the string does not start with one.

    Enough for DeepSpeed's X.Y.Z versions without depending on ``packaging``, which smp2ds does not declare.
    """
    match = re.match(r"(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def require_deepspeed(installed: str | None) -> None:
    """Raise ``SMPUnsupportedError`` naming the version and the fix unless DeepSpeed >= MIN_DEEPSPEED."""
    fix = f"install a supported one: pip install 'deepspeed>={MIN_DEEPSPEED}'"
    if installed is None:
        raise SMPUnsupportedError(f"DeepSpeed is not installed; smp2ds runs on DeepSpeed >= {MIN_DEEPSPEED}: {fix}")
    have, need = release(installed), release(MIN_DEEPSPEED)
    if have is None:
        return  # a local build with an unusual version string: let it run rather than guess
    if have < need:
        raise SMPUnsupportedError(
            f"DeepSpeed {installed} is installed, but smp2ds needs DeepSpeed >= {MIN_DEEPSPEED}: {fix}"
        )
