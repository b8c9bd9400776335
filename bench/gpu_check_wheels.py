"""Offline installation for ``bench/gpu_check.py``: wheels prepared where the package index is reachable,
installed on a bare GPU image that has torch, transformers and accelerate but no index.

* :func:`prepare` (``gpu_check.py --prepare-wheels DIR``) builds DeepSpeed as a wheel (PyPI ships only its
  source; the wheel is pure Python, its CUDA ops are compiled on first use) and downloads binary wheels of
  what DeepSpeed and jsonschema need beyond torch, for the target Python and platform.
* :func:`ensure` (``gpu_check.py --wheels DIR``) installs the missing ones with ``pip install --no-index
  --find-links DIR`` and makes ``smp2ds`` importable from the checkout without pip (a folder of links that
  maps ``smp2ds.engine`` to ``engine/`` as ``setup.py`` does, put on ``PYTHONPATH``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("deepspeed", "jsonschema")
"""What smp2ds needs that a torch + transformers + accelerate image lacks."""
DEEPSPEED_VERSION = "0.19.8"
DEEPSPEED_DEPS = ("einops", "hjson", "msgpack", "ninja", "py-cpuinfo", "pydantic>=2.0.0")
"""What a torch + transformers + accelerate image lacks of DeepSpeed 0.19.8's requirements
(``importlib.metadata.requires('deepspeed')``, extras off: einops, hjson, msgpack, ninja, numpy, packaging,
psutil, py-cpuinfo, pydantic, torch, tqdm): numpy, packaging and tqdm come with transformers, psutil with
accelerate. pip adds pydantic's pydantic-core, annotated-types, typing-inspection and typing-extensions."""
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
"""Binary wheels are fetched for each (a few MB each), so one folder serves whatever Python the image has."""
JSONSCHEMA_DEPS = ("jsonschema>=4.18",)
"""jsonschema pulls attrs, jsonschema-specifications, referencing and rpds-py (binary)."""
PACKAGE_DIRS = {"translator": "translator", "engine": "engine", "schemas": "schemas"}
"""``smp2ds.<name>`` -> folder of the checkout, as in ``setup.py``."""


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]


PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_12_x86_64",
             "manylinux2010_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
"""x86-64 Linux with glibc >= 2.28 (the CUDA images'): pip takes a wheel only for a platform named here."""


def prepare(dest: Path, python_versions: list[str], platforms: list[str]) -> int:
    """Fill ``dest`` with the wheels :func:`ensure` installs; returns pip's exit status (0 ok)."""
    dest.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_BUILD_OPS": "0"}  # a pure-Python wheel: CUDA ops are JIT-compiled on the GPU host
    steps = [
        # PyPI has DeepSpeed's source only; building needs torch importable here (no build isolation)
        _pip("wheel", "--no-deps", "--no-build-isolation", f"deepspeed=={DEEPSPEED_VERSION}", "-w", str(dest)),
    ]
    for version in python_versions:
        abi = "cp" + version.replace(".", "")
        steps.append(_pip("download", "--only-binary=:all:", "--python-version", version, "--implementation", "cp",
                          "--abi", abi, "--abi", "abi3", "--abi", "none",
                          *(arg for p in (*platforms, "any") for arg in ("--platform", p)),
                          "-d", str(dest), *DEEPSPEED_DEPS, *JSONSCHEMA_DEPS))
    for cmd in steps:
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd, env=env)
        if rc:
            return rc
    names = sorted(p.name for p in dest.glob("*.whl"))
    print(f"{len(names)} wheels in {dest}: {', '.join(names)}")
    return 0


def missing() -> list[str]:
    """The packages of :data:`NEEDED` this interpreter cannot import."""
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def ensure(wheels: Path | None) -> tuple[list[str], dict[str, str]]:
    """Install what is missing from ``wheels`` and return (problems, environment for the case processes)."""
    problems: list[str] = []
    absent = missing()
    if absent and wheels is None:
        problems.append(f"missing {', '.join(absent)}: pass --wheels DIR (made by --prepare-wheels DIR)")
    elif absent:
        cmd = _pip("install", "--no-index", "--find-links", str(wheels), *absent)
        print("+", " ".join(cmd), flush=True)
        if subprocess.call(cmd):
            problems.append(f"pip could not install {', '.join(absent)} from {wheels}")
    env = dict(os.environ)
    if importlib.util.find_spec("smp2ds") is None or importlib.util.find_spec("smp2ds.engine") is None:
        farm = _link_farm()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(farm), env.get("PYTHONPATH", "")) if p)
    return problems, env


def _link_farm() -> Path:
    """A folder whose ``smp2ds/<name>`` and ``smdistributed`` link to the checkout (no install needed)."""
    farm = Path(tempfile.mkdtemp(prefix="smp2ds-path-"))
    (farm / "smp2ds").mkdir()
    for name, folder in PACKAGE_DIRS.items():
        (farm / "smp2ds" / name).symlink_to(ROOT / folder, target_is_directory=True)
    (farm / "smdistributed").symlink_to(ROOT / "smdistributed", target_is_directory=True)
    return farm
