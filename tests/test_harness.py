"""The multi-rank harness itself: results by rank, failures and hangs name the rank."""

import os

import pytest

from tests._dist import RankFailed, RankTimeout, run_ranks


def _allreduce_rank() -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ["SMP2DS_INIT_METHOD"],
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(os.environ["RANK"]), t.item()


def _fail_on_rank_one() -> int:
    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")
    return 0


def _hang_on_rank_zero() -> int:
    import time

    if os.environ["RANK"] == "0":
        time.sleep(600)
    return 0


@pytest.mark.slow
def test_results_come_back_by_rank_after_a_real_allreduce():
    assert run_ranks(_allreduce_rank, 2) == [(0, 3.0), (1, 3.0)]


def test_failure_names_the_rank_and_its_error():
    with pytest.raises(RankFailed, match=r"rank 1 failed[\s\S]*boom on purpose"):
        run_ranks(_fail_on_rank_one, 2, timeout_s=60)


def test_hang_is_killed_and_names_the_rank():
    with pytest.raises(RankTimeout, match=r"ranks \[0\] did not finish within 8s"):
        run_ranks(_hang_on_rank_zero, 2, timeout_s=8)


def _read_env(name: str) -> str | None:
    return os.environ.get(name)


def test_ranks_never_inherit_what_the_test_monkeypatched(monkeypatch):
    """The fork server lives for the session: started under a test's monkeypatched variable, it would hand that
    variable to every later test's ranks (accelerate's PARALLELISM_CONFIG_* once turned later Trainer runs into a
    4-rank mesh). It is started in the session's environment; a rank sees only that, BASE_ENV and ``env``."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()  # the next run starts the server afresh, while the variable is set
    monkeypatch.setenv("SMP2DS_LEAK_PROBE", "leaked")
    assert run_ranks(_read_env, 2, "SMP2DS_LEAK_PROBE", timeout_s=120) == [None, None]
    assert run_ranks(_read_env, 2, "SMP2DS_LEAK_PROBE", timeout_s=120, env={"SMP2DS_LEAK_PROBE": "given"}) == [
        "given", "given"]
