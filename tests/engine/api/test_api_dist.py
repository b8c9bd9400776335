"""The smp.* API surface on 2 real ranks: ranks and groups, collectives, misuse errors, hooks,
state dicts, activation checkpointing and per-rank file naming (one spawned run)."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.engine.workers.api_workers import api_checks


@pytest.mark.slow
def test_api_surface_on_two_ranks(tmp_path):
    res = run_ranks(api_checks, 2, str(tmp_path))
    for r, out in enumerate(res):
        assert out["second_init_warns"]
        # rank, size, local, dp, pp, tp, mp, rdp, microbatches (pure data parallel: dp = rdp = world)
        assert out["ranks"] == (r, 2, r, 2, r, 2, 0, 1, 0, 1, 0, 1, r, 2, 2)
        assert out["groups"] == ([0, 1], [r], [r], [r], [0, 1]) and out["pg"]
        assert out["cfg"] == (2, False, False, False, "spread", False)
        assert out["mpu"] == (r, 2, 1)
        assert out["allgather"] == [0, 10] and out["gather"] == ([0, 1] if r == 0 else None)
        assert "not a communication group" in out["bad_group"]
        assert "before smp.DistributedModel" in out["step_before_model"]
        assert "before smp.DistributedOptimizer" in out["opt_before_model"]
        assert "unknown argument(s) ['trace_devise']" in out["unknown_arg"]
        assert out["explained"] == ["broadcast_buffers", "bucket_cap_mb"] and out["explained_warned"] == 2
        assert "only one smp.DistributedModel" in out["second_model"]
        assert "do not belong to the DistributedModel" in out["foreign"]
        assert "inside an @smp.step function" in out["backward_outside"]
        assert "microbatches=2: dimension 0 has size 3" in out["not_divisible"]
        assert out["hooks"] == ["partition", "step"] and out["late_hook"] == "late"  # SMP: once, after step 1
        assert out["names"] and out["sd_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert out["local_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight", "_smp6_is_partial".replace("6", ""),
                                     "_smp_load_info"]
        assert out["is_module_eval"] == (False, True)
        assert out["ckpt_equal"] and out["ckpt_fn"]
        assert out["load_v3"] == {"r": r} and "objv3_*" not in out["missing"] and "1 part(s)" in out["missing"]
        assert out["nn"] == (5, 3) and "ALiBi attention biases is not implemented" in out["nn_unsupported"]
    assert res[1]["recv"] == [0, 1, 2] and res[1]["recv2"] == "to one" and res[0]["recv"] == ("back", 1)
    assert res[0]["load_own"]["r"] in (0, 1)


@pytest.mark.slow
def test_every_smp_group_connects_the_ranks_the_topology_names():
    """pp=2 x dp=2 under 'spread' (TPD): coordinates, rank lists, allgather order and real
    all-reduces over each torch process group agree with the pure topology."""
    from tests.engine.workers.api_workers import group_checks

    res = run_ranks(group_checks, 4, {"ddp": True, "partitions": 2, "placement_strategy": "spread"})
    assert sorted(r["coords"][0] for r in res) == [0, 0, 1, 1]
    for out in res:
        assert out["coords_ok"]
        for kind in ("pp", "rdp", "dp", "mp", "tp"):
            g = out[kind]
            assert g["allgather"] == g["members"] == g["lister"], (kind, g)
            assert g["sum"] == g["expected_sum"], (kind, g)


@pytest.mark.slow
@pytest.mark.parametrize("config,chain", [
    ({"ddp": True}, ["DataParallelWrapper"]),
    ({"ddp": True, "bf16": True}, ["DataParallelWrapper", "Bit16Wrapper"]),
    ({"ddp": False, "partitions": 2, "microbatches": 1}, []),
    ({"ddp": True, "sharded_data_parallel_degree": 2}, []),
])
def test_model_module_is_the_wrapper_chain_smp_scripts_walk(config, chain):
    """SMP's ``model.module``: its DDP wrapper under ddp (not under sharded data parallelism), a 16-bit wrapper
    inside it under bf16; the wrappers are invisible to names, ``modules()`` and ``state_dict``."""
    from tests.engine.workers.api_workers import wrapper_chain_checks

    for out in run_ranks(wrapper_chain_checks, 2, config):
        assert out["chain"] == chain
        assert out["ddp_instance"] == (chain[:1] == ["DataParallelWrapper"])
        assert out["custom"] == 7 and out["get_module"]
        assert out["same_call"] in (True, None)
        assert out["names"] == ["0.bias", "0.weight", "1.bias", "1.weight"] and out["modules"] == 4  # DistributedModel, Sequential, 2 Linear
