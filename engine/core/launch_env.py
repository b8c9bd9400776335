"""Who launched this process, and how the ranks meet (rendezvous).

SMP v1 jobs were started by ``mpirun`` and took ranks from OpenMPI; smp2ds scripts may also be
started by the ``deepspeed`` launcher, ``torchrun`` or as one plain process. This module only
reads environment variables (no torch), so it is cheap and unit-testable.

Rendezvous precedence (first match wins):

1. ``SMP2DS_INIT_METHOD`` (``file://PATH``, ``tcp://HOST:PORT`` or ``env://``) — the test
   harness uses a file so no port is needed;
2. the ``ddp_port`` config key (SMP semantics: it overrides the port) with ``MASTER_ADDR``;
3. under ``torchrun``, the agent's own store (``TORCHELASTIC_USE_AGENT_STORE``);
4. ``MASTER_ADDR`` / ``MASTER_PORT`` (deepspeed launcher, torchrun, SageMaker's container);
5. under ``mpirun`` with neither: ``127.0.0.1`` when every rank is on this node, else the host of
   ``mpirun`` itself (from ``OMPI_MCA_orte_hnp_uri``; rank 0 runs there under ``--map-by slot``),
   and a port derived from the OpenMPI job id so two jobs on one machine do not collide;
6. a single process: a private file store.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Launcher = Literal["deepspeed", "torchrun", "mpirun", "env", "single"]

SMP_FALLBACK_PORT = 29760
"""SMP's own fallback DDP port when nothing else is given."""


class LaunchEnvError(RuntimeError):
    """The environment does not describe a usable set of ranks (message says what is missing)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where ranks meet: a file store (``path``) or a TCP store (``host``/``port``)."""

    kind: Literal["file", "tcp"]
    path: str | None = None
    host: str | None = None
    port: int | None = None
    agent_store: bool = False
    """True under torchrun: the elastic agent hosts the store, every worker is a client."""
    prefix: str = ""
    """Key prefix inside a shared store (torchrun namespaces each restart attempt)."""

    def describe(self) -> str:
        if self.kind == "file":
            return f"file://{self.path}"
        owner = "torchrun agent" if self.agent_store else "rank 0"
        return f"tcp://{self.host}:{self.port} (store hosted by {owner})"


@dataclass(frozen=True)
class LaunchEnv:
    """Rank facts of this process and how to rendezvous with the others."""

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    rendezvous: Rendezvous

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_size))


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as exc:
                raise LaunchEnvError(f"environment variable {name}={value!r} is not an integer") from exc
    return None


def seconds_knob(name: str, default: float, env: Mapping[str, str] | None = None, zero_means: str = "") -> float:
    """A duration in seconds from environment variable ``name``; a bad value is an error naming it.

    ``zero_means`` says what 0 does (e.g. "disables the watchdog"); without it 0 is refused.
    """
    env = os.environ if env is None else env
    raw = env.get(name, "").strip()
    if raw == "":
        return default
    allowed = "a number of seconds >= 0" + (f" (0 {zero_means})" if zero_means else " and > 0")
    try:
        value = float(raw)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={raw!r} is not a number; allowed: {allowed}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_means):
        raise LaunchEnvError(f"environment variable {name}={raw!r} is out of range; allowed: {allowed}")
    return value


COMM_TIMEOUT_DEFAULT_S = 300.0
PG_TIMEOUT_DEFAULT_S = 1800.0


def comm_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """``SMP2DS_COMM_TIMEOUT``: how long a rank may be silent (dead) or wait in one collective
    (stuck peer) before every rank stops; 0 disables the watchdog."""
    return seconds_knob("SMP2DS_COMM_TIMEOUT", COMM_TIMEOUT_DEFAULT_S, env, zero_means="disables the watchdog")


def pg_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """The gloo/NCCL collective timeout: ``SMP2DS_PG_TIMEOUT`` if set, else derived from
    ``SMP2DS_COMM_TIMEOUT`` (twice it, at least 30 s more) so the watchdog, which names the rank
    that is behind, always acts before a bare backend timeout does."""
    comm = comm_timeout_s(env)
    default = PG_TIMEOUT_DEFAULT_S if comm == 0 else max(2 * comm, comm + 30.0)
    return seconds_knob("SMP2DS_PG_TIMEOUT", default, env)


def _launcher(env: Mapping[str, str]) -> Launcher:
    if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
        return "torchrun"
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:
        return "deepspeed"  # deepspeed/launcher/launch.py sets both
    if "RANK" not in env and "OMPI_COMM_WORLD_RANK" in env:
        return "mpirun"
    if "RANK" in env or "WORLD_SIZE" in env:
        return "env"
    return "single"


def ranks_per_node(env: Mapping[str, str] | None = None) -> int | None:
    """Ranks per node as the launcher reports it (``env``, default ``os.environ``): Open MPI's
    ``OMPI_COMM_WORLD_LOCAL_SIZE`` under mpirun, else torchrun's and DeepSpeed's ``LOCAL_WORLD_SIZE`` /
    ``LOCAL_SIZE`` or MPICH's ``MPI_LOCALNRANKS``; None when it says nothing. The one place this is read."""
    env = os.environ if env is None else env
    if _launcher(env) == "mpirun":
        return _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    return _int(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MPI_LOCALNRANKS")


def _mpirun_host(env: Mapping[str, str], local_size: int, world_size: int) -> str:
    if local_size >= world_size:
        return "127.0.0.1"
    match = re.search(r"tcp://([^;,:]+)", env.get("OMPI_MCA_orte_hnp_uri", ""))
    if match:
        return match.group(1)
    raise LaunchEnvError(
        "mpirun job spans several nodes but MASTER_ADDR is not set and the mpirun host is unknown; "
        "export MASTER_ADDR=<address of rank 0> (mpirun -x MASTER_ADDR=...)"
    )


def _mpirun_port(env: Mapping[str, str]) -> int:
    job = _int(env, "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
    if job is None:
        return SMP_FALLBACK_PORT
    return 20000 + job % 10000


def _rendezvous(env: Mapping[str, str], launcher: Launcher, world: int, local_size: int,
                ddp_port: int | None) -> Rendezvous:
    method = env.get("SMP2DS_INIT_METHOD")
    if method:
        if method.startswith("file://"):
            return Rendezvous("file", path=method[len("file://"):])
        match = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", method)
        if match:
            return Rendezvous("tcp", host=match.group(1), port=int(match.group(2)))
        if method != "env://":
            raise LaunchEnvError(f"SMP2DS_INIT_METHOD={method!r}: expected file://PATH, tcp://HOST:PORT or env://")
    if launcher == "single" and world == 1:
        return Rendezvous("file", path=os.path.join(tempfile.mkdtemp(prefix="smp2ds-single-"), "store"))
    addr = env.get("MASTER_ADDR")
    if ddp_port is not None:
        host = addr or (_mpirun_host(env, local_size, world) if launcher == "mpirun" else "127.0.0.1")
        return Rendezvous("tcp", host=host, port=int(ddp_port))
    if launcher == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return Rendezvous("tcp", host=addr, port=_int(env, "MASTER_PORT"), agent_store=True,
                          prefix=f"/smp2ds/attempt_{attempt}/")
    port = _int(env, "MASTER_PORT")
    if launcher == "mpirun":
        return Rendezvous("tcp", host=addr or _mpirun_host(env, local_size, world), port=port or _mpirun_port(env))
    if addr is None or port is None:
        raise LaunchEnvError(
            f"RANK/WORLD_SIZE are set (world size {world}) but MASTER_ADDR/MASTER_PORT are not; "
            "start the script with torchrun, the deepspeed launcher or mpirun, or export both"
        )
    return Rendezvous("tcp", host=addr, port=port)


def detect(env: Mapping[str, str] | None = None, ddp_port: int | None = None) -> LaunchEnv:
    """Read this process's rank facts and rendezvous from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    launcher = _launcher(env)
    if launcher == "mpirun":
        rank = _int(env, "OMPI_COMM_WORLD_RANK")
        world = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    else:
        rank = _int(env, "RANK")
        world = _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK")
    local_size = ranks_per_node(env)
    rank = 0 if rank is None else rank
    world = 1 if world is None else world
    if not 0 <= rank < world:
        raise LaunchEnvError(f"rank {rank} is outside the world of {world} processes")
    local_size = world if local_size is None else local_size
    local_rank = rank % local_size if local_rank is None else local_rank
    if launcher == "env" and world == 1 and "MASTER_ADDR" not in env and "SMP2DS_INIT_METHOD" not in env:
        launcher = "single"
    return LaunchEnv(launcher, rank, world, local_rank, local_size,
                     _rendezvous(env, launcher, world, local_size, ddp_port))
