"""Run an SMP-style script with ``torchrun`` on CPU (gloo) and collect what each rank wrote.

The script runs unchanged as a user would start it (``torchrun --standalone --nproc-per-node N
script.py ARGS``), with the SageMaker environment SMP scripts read (``SM_HP_MP_PARAMETERS``) and
``SMP2DS_SCRIPT_OUT`` naming a directory where each rank writes ``rank<N>.json``. A failing job
raises `ScriptFailed` with every rank's output; a job past its timeout is killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests._dist import BASE_ENV


class ScriptFailed(RuntimeError):
    """The job exited non-zero or timed out; the message carries its output."""


def run_torchrun(script: str | Path, nproc: int, args: list[str] | None = None, *,
                 smp_parameters: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 timeout_s: float = 300) -> list[dict[str, Any]]:
    """Launch ``script`` on ``nproc`` local ranks; return each rank's JSON result, by rank."""
    with tempfile.TemporaryDirectory(prefix="smp2ds-script-") as out:
        full = dict(os.environ)
        full.update(BASE_ENV)
        full.pop("SMP2DS_INIT_METHOD", None)  # torchrun's own rendezvous (env://)
        full["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        full["SMP2DS_SCRIPT_OUT"] = out
        if smp_parameters is not None:
            full["SM_HP_MP_PARAMETERS"] = json.dumps(smp_parameters)
        full.update(env or {})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(script), *(args or [])]
        try:
            proc = subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ScriptFailed(f"{' '.join(cmd)} ran past {timeout_s}s\n{_text(exc.stdout)}\n{_text(exc.stderr)}") \
                from exc
        if proc.returncode != 0:
            raise ScriptFailed(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                               f"--- stderr\n{proc.stderr[-12000:]}")
        results = []
        for rank in range(nproc):
            path = Path(out, f"rank{rank}.json")
            if not path.exists():
                raise ScriptFailed(f"rank {rank} wrote no result ({path.name})\n{proc.stderr[-6000:]}")
            results.append(json.loads(path.read_text()))
        return results


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
