"""Failures end the job quickly and are reported once, naming the rank (real processes)."""

from __future__ import annotations

import os

import pytest

from smp2ds.engine.core import launch_env
from smp2ds.engine.diagnostics.watchdog import RANK_LOST_EXIT_CODE
from tests.engine.proc_launch import run_script

HERE = os.path.dirname(os.path.dirname(__file__))  # tests/engine: its scripts/ folder
TIMEOUT = 4.0
STUCK_TIMEOUT = 8.0  # a peer may legitimately wait this long at a collective on a loaded 2-core machine


@pytest.mark.slow
@pytest.mark.parametrize("world,victim,how", [(4, 2, "kill"), (2, 1, "raise")])
def test_when_one_rank_dies_the_others_exit_in_bounded_time_naming_it(tmp_path, world, victim, how):
    mark = str(tmp_path / "died_at")
    runs = run_script(os.path.join(HERE, "scripts", "stuck_rank.py"), world, [str(victim), how],
                      env={"SMP2DS_COMM_TIMEOUT": str(TIMEOUT), "FAULT_MARK": mark}, timeout_s=180)
    with open(mark) as handle:
        died_at = float(handle.read())
    survivors = [r for r in runs if r.rank != victim]
    for r in survivors:
        assert r.returncode == RANK_LOST_EXIT_CODE, (r.rank, r.returncode, r.stderr[-2000:])
        expected = f"rank {victim} lost: no heartbeat" if how == "kill" else f"rank {victim} failed: ValueError"
        assert expected in r.stderr, r.stderr[-2000:]
        # bounded: the heartbeat timeout plus a few polling intervals, not a collective timeout
        assert r.ended_at - died_at < TIMEOUT + 10, (r.rank, r.ended_at - died_at)
    if how == "raise":
        victim_run = runs[victim]
        assert victim_run.returncode == 1 and "deliberate failure" in victim_run.stderr


@pytest.mark.slow
def test_config_error_is_reported_once_without_tracebacks():
    bad = '{"microbatches": 0, "pipeline_parallel_degree": 3}'
    runs = run_script(os.path.join(HERE, "scripts", "init_only.py"), 2, env={"SM_HP_MP_PARAMETERS": bad},
                      timeout_s=120)
    text = "".join(r.stderr for r in runs)
    assert [r.returncode for r in runs] == [1, 1]
    assert text.count("invalid SMP configuration") == 1, text
    assert "Traceback" not in text, text
    assert "/microbatches: must be >= 1 (given: 0)" in text


@pytest.mark.slow
def test_config_error_on_one_rank_only_stops_every_rank_and_is_reported_once():
    runs = run_script(os.path.join(HERE, "scripts", "init_only.py"), 2,
                      rank_env={1: {"SM_HP_MP_PARAMETERS": '{"microbatchez": 2}'}}, timeout_s=120)
    text = "".join(r.stderr for r in runs)
    assert [r.returncode for r in runs] == [1, 1], text
    assert text.count("invalid SMP configuration") == 1 and "found on rank(s) [1]" in text, text
    assert "microbatchez" in text and "Traceback" not in text
    assert runs[1].stderr.count("invalid SMP configuration") == 1  # printed by the rank that has it


def _line_of(code: str) -> int:
    """Line number of ``code`` in stuck_rank.py (the messages name the line where the rank is)."""
    with open(os.path.join(HERE, "scripts", "stuck_rank.py")) as handle:
        return next(n for n, line in enumerate(handle, 1) if code in line)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sleep", "alone"])
def test_a_rank_alive_but_stuck_stops_every_rank_naming_it(tmp_path, how):
    """The stuck rank keeps heartbeating, so only lack of progress can reveal it."""
    mark, victim = str(tmp_path / "stuck_at"), 1
    runs = run_script(os.path.join(HERE, "scripts", "stuck_rank.py"), 2, [str(victim), how],
                      env={"SMP2DS_COMM_TIMEOUT": str(STUCK_TIMEOUT), "FAULT_MARK": mark}, timeout_s=180)
    with open(mark) as handle:
        stuck_at = float(handle.read())
    text = runs[0].stderr + runs[1].stderr
    for r in runs:
        assert r.returncode == RANK_LOST_EXIT_CODE, (r.rank, r.returncode, r.stderr[-2000:])
        # bounded: the progress timeout plus polling, far below the collective (PG) timeout
        assert r.ended_at - stuck_at < STUCK_TIMEOUT + 10, (r.rank, r.ended_at - stuck_at)
        assert "smp2ds: rank" in r.stderr and "stops because" in r.stderr, r.stderr[-2000:]
    if how == "sleep":
        assert f"rank 1 is not in a collective at stuck_rank.py:{_line_of('time.sleep(3600)')} in <module>, step 3" in text, text[-3000:]
        assert "rank 0 waited" in text
    else:
        assert "rank 1 is in collective" in text or "rank 0 is in collective" in text, text[-3000:]
        assert f"stuck_rank.py:{_line_of('smp.allgather((')} in <module>" in text, text[-3000:]


@pytest.mark.parametrize(
    ("name", "value", "reader", "expected"),
    [
        ("SMP2DS_PG_TIMEOUT", "abc", launch_env.pg_timeout_s, "SMP2DS_PG_TIMEOUT='abc' is not a number"),
        ("SMP2DS_PG_TIMEOUT", "0", launch_env.pg_timeout_s, "SMP2DS_PG_TIMEOUT='0' is out of range"),
        ("SMP2DS_PG_TIMEOUT", "nan", launch_env.pg_timeout_s, "SMP2DS_PG_TIMEOUT='nan' is out of range"),
        ("SMP2DS_COMM_TIMEOUT", "-1", launch_env.comm_timeout_s, "SMP2DS_COMM_TIMEOUT='-1' is out of range"),
        ("SMP2DS_COMM_TIMEOUT", "5m", launch_env.pg_timeout_s, "SMP2DS_COMM_TIMEOUT='5m' is not a number"),
    ],
)
def test_every_timeout_knob_is_validated_naming_it(name, value, reader, expected):
    with pytest.raises(launch_env.LaunchEnvError) as caught:
        reader({name: value})
    assert expected in str(caught.value) and "allowed: a number of seconds" in str(caught.value)


def test_timeout_knob_defaults_derive_the_collective_timeout_from_the_watchdog_one():
    assert launch_env.comm_timeout_s({}) == 300.0 and launch_env.pg_timeout_s({}) == 600.0
    assert launch_env.pg_timeout_s({"SMP2DS_COMM_TIMEOUT": "10"}) == 40.0  # 10 + 30: the watchdog acts first
    assert launch_env.pg_timeout_s({"SMP2DS_COMM_TIMEOUT": "0"}) == 1800.0  # watchdog off: torch's usual
    assert launch_env.pg_timeout_s({"SMP2DS_PG_TIMEOUT": "90", "SMP2DS_COMM_TIMEOUT": "10"}) == 90.0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sleep", "kill"])
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_a_stuck_or_dead_rank_stops_the_job_within_the_same_bound_under_the_launchers(tmp_path, launcher, how):
    import shutil
    import socket
    import subprocess
    import sys
    import time

    from tests._dist import BASE_ENV

    program = shutil.which(launcher)
    assert program, f"{launcher} is not installed"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    mark = str(tmp_path / "stuck_at")
    script = [os.path.join(HERE, "scripts", "stuck_rank.py"), "1", how]
    command = ([program, "--nproc-per-node", "2", "--master-port", port, *script] if launcher == "torchrun"
               else [program, "--num_gpus", "2", "--master_port", port, *script])
    env = dict(os.environ, **BASE_ENV, SMP2DS_COMM_TIMEOUT=str(STUCK_TIMEOUT), FAULT_MARK=mark,
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SMP2DS_INIT_METHOD"):
        env.pop(name, None)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, check=False,
                          cwd=str(tmp_path))
    ended = time.time()
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    if how == "sleep":
        assert f"rank 1 is not in a collective at stuck_rank.py:{_line_of('time.sleep(3600)')} in <module>, step 3" in text, text[-3000:]
    with open(mark) as handle:
        stuck_at = float(handle.read())
    assert ended - stuck_at < STUCK_TIMEOUT + 15, ended - stuck_at  # the launcher exits too, not only ranks


def _blocked_in_a_collective(started, release):
    """Stands for user code blocked in torch.distributed (a function whose module says so)."""
    scope = {"__name__": "torch.distributed.distributed_c10d"}
    exec("def all_reduce(started, release):\n    started.set()\n    release.wait()\n", scope)
    scope["all_reduce"](started, release)


def test_stall_sampling_finds_the_collective_and_the_user_line_and_the_verdict_names_who_is_behind():
    import threading

    from smp2ds.engine.diagnostics import stall

    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_blocked_in_a_collective, args=(started, release), daemon=True)
    worker.start()
    started.wait(10)
    try:
        position, entry = stall.sample(worker.ident)
        again, entry_again = stall.sample(worker.ident)
    finally:
        release.set()
        worker.join(10)
    assert position.collective == "all_reduce" and entry is not None and entry_again is entry  # same call
    line = _line_of_here("scope[\"all_reduce\"](started, release)")
    assert position.where == f"test_faults_dist.py:{line} in _blocked_in_a_collective", position
    assert stall.Position.from_json(position.to_json()) == position and stall.Position.from_json("{") is None
    idle = stall.Position(3, None, None, "train.py:36 in <module>")
    verdict = stall.stall_verdict(0, 8.4, position, {1: idle, 2: None, 3: position}, {4})
    assert verdict.startswith("rank(s) not progressing: rank 1 is not in a collective at train.py:36 in <module>, "
                              "step 3; rank 2 (position unknown); rank 4 has already finished (rank 0 waited 8 s in "
                              "collective all_reduce at test_faults_dist.py:"), verdict
    assert "rank 3" not in verdict  # waiting in the same call: not behind
    assert stall.stall_verdict(0, 9, position, {1: position}, set()).startswith(
        "every rank is stuck in the same collective")


def _line_of_here(code: str) -> int:
    with open(__file__) as handle:
        return next(n for n, line in enumerate(handle, 1) if code in line and "_line_of_here" not in line)


def test_a_rank_waiting_in_a_collective_names_a_silent_peer_as_lost_not_as_stuck():
    """Rank 0 of 3 waits in a collective; its ring neighbour (rank 1) beats, rank 2 has died.
    The wait's verdict must name rank 2 as lost (its heartbeat stopped), whichever check fires first."""
    import threading
    import time

    import torch.distributed as dist

    from smp2ds.engine.diagnostics.watchdog import Watchdog

    store = dist.HashStore()
    for r in (1, 2):
        store.add(f"hb/{r}", 1)
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=_blocked_in_a_collective, args=(started, release), daemon=True)
    worker.start()
    started.wait(10)
    dog = Watchdog(lambda: store, rank=0, world_size=3, timeout_s=0.6)
    dog._main_thread = worker.ident  # the blocked thread stands for the training loop
    verdict, deadline = None, time.monotonic() + 10
    try:
        while verdict is None and time.monotonic() < deadline:
            store.add("hb/1", 1)  # rank 1 alive (so the ring check on rank 1 never fires)
            verdict = dog._tick()
            time.sleep(dog.interval_s)
    finally:
        release.set()
        worker.join(10)
    assert verdict is not None and verdict.startswith("rank 2 lost: no heartbeat for "), verdict
    assert verdict.endswith("(noticed by rank 0)") and store.get("abort").decode() == verdict
