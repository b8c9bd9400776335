"""``convert --to slurm`` submitted to a real Slurm: a one-machine cluster started by the test.

The test writes a ``slurm.conf`` for this host alone (one node with 2 CPUs: several nodes on one host need a
Slurm built with ``--enable-multiple-slurmd``), starts ``munged`` (with a key it generates), ``slurmctld`` and
``slurmd`` in the foreground with every state, spool and log file in a temporary folder, and submits the sbatch
script that ``smp2ds convert --to slurm --cpu`` wrote for ``examples/train_smp_mlp.py`` (unchanged; named by the
estimator's ``source_dir`` and a relative ``entry_point``) with ``sbatch --wait``: the node taken whole
(``--exclusive``, srun's one task with every CPU of it), srun starts torchrun on the node, torchrun the 2 ranks. The run must train and print the same final
weights digest as plain ``torchrun`` with the same ``SM_HP_MP_PARAMETERS`` (as ``tests/engine/api/test_launchers.py``
runs it), write its weights and checkpoint into the folders given to ``--output-dir`` / ``--checkpoint-dir``, and
``smp2ds launch`` inside ``srun`` must take its defaults from the allocation. Every daemon the test started is
stopped in ``finally``. Needs root (slurmd starts job steps as their user) and Debian's ``slurm-wlm`` and
``munge`` (``.ci/setup`` installs them); skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from smp2ds.cli import main
from tests._dist import BASE_ENV

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_smp_mlp.py"
SMP = {"ddp": True, "microbatches": 2, "shard_optimizer_state": True}
STEPS, BATCH, LR = 6, 8, 0.05
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


def _missing() -> str | None:
    absent = [name for name in DAEMONS if shutil.which(name) is None and not os.path.exists(f"/usr/sbin/{name}")]
    if absent:
        return f"Slurm/munge not installed ({', '.join(absent)} missing; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a private Slurm cluster needs root (slurmd runs job steps as their user)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _slurm_conf(base: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=smp2dstest", f"SlurmctldHost={host}", f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        "CredType=cred/munge", f"AuthInfo=socket={base}/munge/socket", f"StateSaveLocation={base}/state",
        f"SlurmdSpoolDir={base}/spool", f"SlurmctldPidFile={base}/slurmctld.pid", f"SlurmdPidFile={base}/slurmd.pid",
        f"SlurmctldLogFile={base}/log/slurmctld.log", f"SlurmdLogFile={base}/log/slurmd.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "ReturnToService=2",
        f"NodeName={host} CPUs=2 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A running one-node Slurm cluster: the environment that reaches it (``SLURM_CONF``)."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        pytest.skip(f"this host's name {host!r} does not resolve; slurmd and torchrun need it to")
    base = tmp_path / "slurm"
    for sub in ("munge", "state", "spool", "log"):
        (base / sub).mkdir(parents=True)
    (base / "munge").chmod(0o711)
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = base / "slurm.conf"
    conf.write_text(_slurm_conf(base, host), encoding="utf-8")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in [n for n in env if n.startswith("SLURM_") and n != "SLURM_CONF"]:
        del env[name]  # a test run inside an allocation must not hand that job's variables to this cluster
    started: list[subprocess.Popen] = []
    try:
        logs = (base / "log" / "daemons.out").open("w")
        started.append(subprocess.Popen(
            [_which("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={base}/munge/socket",
             f"--pid-file={base}/munge/pid", f"--log-file={base}/log/munged.log", f"--seed-file={base}/munge/seed"],
            stdout=logs, stderr=subprocess.STDOUT, start_new_session=True))
        _wait(lambda: (base / "munge" / "socket").exists(), 10, "munged did not create its socket", base)
        for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            started.append(subprocess.Popen([_which(daemon[0]), *daemon[1:], "-f", str(conf)], env=env, stdout=logs,
                                            stderr=subprocess.STDOUT, start_new_session=True))
        _wait(lambda: _idle(env), 30, "the node did not become idle", base)
        yield env
    finally:
        if any(p.poll() is None for p in started[1:]):
            subprocess.run([_which("scancel"), "--full", "--user=root"], env=env, capture_output=True, timeout=10,
                           check=False)
        for proc in reversed(started):
            _stop(proc)


def _idle(env: dict[str, str]) -> bool:
    proc = subprocess.run([_which("sinfo"), "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=10,
                          check=False)
    return proc.returncode == 0 and proc.stdout.strip() == "idle"


def _wait(ready, seconds: float, what: str, base: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((base / "log").iterdir()))
    raise AssertionError(f"{what} within {seconds} s\n{logs}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop a daemon this test started, and whatever it started in its session (job steps)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session (start_new_session): nothing else is in it
    except (ProcessLookupError, PermissionError):
        pass


def _plain_torchrun_argv() -> list[str]:
    """The example under plain torchrun, as tests/engine/api/test_launchers.py runs it."""
    return [_which("torchrun"), "--nproc-per-node", "2", "--master-port", str(_free_port()), str(SCRIPT),
            "--steps", str(STEPS), "--batch-size", str(BATCH), "--lr", str(LR)]


@pytest.mark.slow
def test_sbatch_script_trains_the_example_like_plain_torchrun(cluster, tmp_path, capsys):
    spec = {
        # source_dir + a relative entry point: the script cds there first, as SageMaker ran the entry point from it
        "entry_point": SCRIPT.name, "source_dir": str(SCRIPT.parent), "instance_type": "ml.g5.12xlarge",
        "instance_count": 1,
        # SageMaker's paths, mapped by --output-dir / --checkpoint-dir; batch-size is a hyphenated name
        "hyperparameters": {"steps": STEPS, "batch-size": BATCH, "lr": LR, "dump-weights": "/opt/ml/model/final.pt",
                            "checkpoint-dir": "/opt/ml/checkpoints"},
        "distribution": {"mpi": {"enabled": True, "processes_per_host": 2},
                         "smdistributed": {"modelparallel": {"enabled": True, "parameters": SMP}}},
    }
    estimator = tmp_path / "estimator.json"
    estimator.write_text(json.dumps(spec), encoding="utf-8")
    job, ckpt, script = tmp_path / "job", tmp_path / "ckpt", tmp_path / "train.sbatch"
    assert main(["convert", str(estimator), "--to", "slurm", "--cpu", "--output-dir", str(job),
                 "--checkpoint-dir", str(ckpt), "-o", str(script)]) == 0, capsys.readouterr().err
    env = {**cluster, **BASE_ENV, "RDZV_PORT": str(_free_port()),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = tmp_path / "slurm-job.out"
    # plain torchrun runs beside the Slurm job: the machine has time for both, the test less so
    reference = subprocess.Popen(_plain_torchrun_argv(), env={**cluster, **BASE_ENV, "SM_HP_MP_PARAMETERS":
                                 json.dumps({**SMP, "partitions": 1})}, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path))
    try:
        proc = subprocess.run([_which("sbatch"), "--wait", f"--output={out}", f"--chdir={tmp_path}", str(script)],
                              env=env, capture_output=True, text=True, timeout=150, check=False)
        plain, _ = reference.communicate(timeout=150)
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    assert reference.returncode == 0, plain[-4000:]
    log = out.read_text(errors="replace") if out.exists() else ""
    assert proc.returncode == 0, f"sbatch: {proc.stdout}{proc.stderr}\n{log[-4000:]}"
    assert len(re.findall(r"^step \d+ loss", log, re.MULTILINE)) == STEPS, log[-3000:]
    digests = re.findall(r"final weights sha256 (\w+)", log)
    assert len(digests) == 1, log[-3000:]
    assert (job / "model" / "final.pt").is_file()  # /opt/ml/model mapped by --output-dir
    assert any(ckpt.iterdir())  # /opt/ml/checkpoints mapped by --checkpoint-dir
    # what plain torchrun printed with the same SM_HP_MP_PARAMETERS (the plan adds partitions 1 for SMP v1)
    assert digests == re.findall(r"final weights sha256 (\w+)", plain), plain[-3000:]

    # smp2ds launch in the batch script and inside srun: nodes, rank and processes per node come from SLURM_*
    config = tmp_path / "smp.json"
    config.write_text(json.dumps(SMP), encoding="utf-8")
    launch = (f"{sys.executable} -m smp2ds.cli launch --config {config} --launcher torchrun --dry-run "
              f"--format json -- {SCRIPT}")
    wrap = f"{launch} > batch.json && srun --ntasks=1 --ntasks-per-node=1 {launch} > step.json"
    proc = subprocess.run([_which("sbatch"), "--wait", "--ntasks-per-node=2", f"--output={tmp_path}/launch.out",
                           f"--chdir={tmp_path}", f"--wrap={wrap}"], env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n{(tmp_path / 'launch.out').read_text()}"
    for name, nproc in (("batch.json", "2"), ("step.json", "1")):  # the allocation's 2 tasks; srun's 1 says nothing
        dry = json.loads((tmp_path / name).read_text())
        command = dry["command"]
        assert command[command.index("--nnodes") + 1] == "1" and command[command.index("--node-rank") + 1] == "0"
        assert command[command.index("--nproc-per-node") + 1] == nproc, name
        assert dry["notices"][0].startswith("Slurm job "), dry["notices"]
