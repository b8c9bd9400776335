"""Start a script as N plain processes (one per rank) with file rendezvous, capturing output.

Unlike tests/_dist.py this runs real ``python script.py`` processes, so uncaught exceptions,
``sys.excepthook`` and exit codes behave as in a user's job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from tests._dist import BASE_ENV


@dataclass
class RankRun:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    ended_at: float


def run_script(script: str, world: int, args: list[str] | None = None, env: dict | None = None,
               rank_env: dict[int, dict] | None = None, timeout_s: float = 240) -> list[RankRun]:
    """Run ``script`` on ``world`` ranks; kill everything still alive after ``timeout_s``."""
    with tempfile.TemporaryDirectory(prefix="smp2ds-proc-") as tmp:
        procs, files = [], []
        for rank in range(world):
            full = dict(os.environ)
            full.update(BASE_ENV)
            full.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                         "LOCAL_WORLD_SIZE": str(world), "SMP2DS_INIT_METHOD": f"file://{tmp}/rendezvous",
                         "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
            full.update(env or {})
            full.update((rank_env or {}).get(rank, {}))
            # kept open while the process runs; closed below
            out, err = open(f"{tmp}/out{rank}", "w+"), open(f"{tmp}/err{rank}", "w+")  # noqa: SIM115
            files.append((out, err))
            procs.append(subprocess.Popen([sys.executable, script, *(args or [])], env=full, stdout=out, stderr=err))
        ended = [0.0] * world
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            for r, p in enumerate(procs):
                if p.poll() is not None and not ended[r]:
                    ended[r] = time.time()
            time.sleep(0.1)
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                p.wait()
            elif not ended[r]:
                ended[r] = time.time()
        runs = []
        for r, (p, (out, err)) in enumerate(zip(procs, files)):
            out.seek(0)
            err.seek(0)
            runs.append(RankRun(r, p.returncode, out.read(), err.read(), ended[r]))
            out.close()
            err.close()
        return runs
