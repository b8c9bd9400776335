"""SMP keys whose fate is "mapped" to a DeepSpeed setting, shown in the engine that actually runs.

Each case starts 2 real ranks, calls ``smp.init`` with an SMP dict as a script would, wraps a
model and an optimizer, and reads the setting back from DeepSpeed's *running* engine (its own
accessors and partitioned parameters), next to a run with another value of the same key, so a
key that stopped reaching DeepSpeed fails here.
"""

from __future__ import annotations

import pytest

from tests._dist import run_ranks


def _engine_settings(config: dict) -> dict:
    import torch

    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    torch.manual_seed(0)
    with smp.model_creation():
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
    model = smp.DistributedModel(module)
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    engine = model.backend.engine
    zero = engine._config.zero_config
    out = {
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "zero_stage": engine.zero_optimization_stage(),
        "bf16": engine.bfloat16_enabled(),
        "fp16": engine.fp16_enabled(),
        "param_shard_size": smp.param_shard_size(),
        "gradient_clipping": engine.gradient_clipping(),
        "reduce_bucket_size": int(zero.reduce_bucket_size),
        "persistence_threshold": int(zero.param_persistence_threshold),
        "max_live_parameters": int(zero.max_live_parameters),
        "backend": smp.state.backend_name,
    }
    if out["zero_stage"] == 3:
        # Parameters below the persistence threshold stay whole on every rank (ds_persist).
        out["persistent"] = sorted(name for name, p in module.named_parameters() if p.ds_persist)
    smp.barrier()
    return out


SDP = {"ddp": True, "sharded_data_parallel_degree": 2, "delayed_parameter_initialization": True}


@pytest.mark.slow
def test_mapped_keys_reach_the_running_deepspeed_engine():
    plain = run_ranks(_engine_settings, 2, {"ddp": True, "microbatches": 2})[0]
    assert plain["gradient_accumulation_steps"] == 2 and plain["zero_stage"] == 0 and not plain["bf16"]
    assert plain["backend"] == "gloo"  # ddp_dist_backend "auto" on a machine without CUDA

    zero1 = run_ranks(_engine_settings, 2, {"ddp": True, "microbatches": 4, "shard_optimizer_state": True,
                                            "bf16": True})[0]
    assert zero1["gradient_accumulation_steps"] == 4 and zero1["zero_stage"] == 1 and zero1["bf16"]

    # sdp_*: ZeRO-3 settings inside the shard group, two values each so a dropped key shows.
    low = run_ranks(_engine_settings, 2, {**SDP, "sdp_reduce_bucket_size": 1000,
                                          "sdp_param_persistence_threshold": 0,
                                          "sdp_max_live_parameters": 5000, "sdp_gradient_clipping": 0.25})[0]
    high = run_ranks(_engine_settings, 2, {**SDP, "sdp_reduce_bucket_size": 2000,
                                           "sdp_param_persistence_threshold": 20,
                                           "sdp_max_live_parameters": 7000, "sdp_gradient_clipping": 2.0})[0]
    assert low["zero_stage"] == high["zero_stage"] == 3
    assert (low["reduce_bucket_size"], high["reduce_bucket_size"]) == (1000, 2000)
    assert (low["max_live_parameters"], high["max_live_parameters"]) == (5000, 7000)
    assert (low["gradient_clipping"], high["gradient_clipping"]) == (0.25, 2.0)
    assert (low["persistence_threshold"], high["persistence_threshold"]) == (0, 20)
    # Threshold 20 keeps the biases (16 and 2 elements) whole; 0 partitions everything.
    assert low["persistent"] == [] and high["persistent"] == ["0.bias", "1.bias"]


@pytest.mark.slow
def test_deprecated_fp16_params_and_v2_hybrid_shard_degree_reach_the_engine():
    fp16 = run_ranks(_engine_settings, 2, {"ddp": True, "fp16_params": True},
                     env={"SMP2DS_ALLOW_CPU_FP16": "1"})[0]
    assert fp16["fp16"] and not fp16["bf16"]
    # SMP v2: hybrid_shard_degree is the MiCS shard size (ZeRO-3 inside groups of that size).
    v2 = run_ranks(_engine_settings, 2, {"hybrid_shard_degree": 2})[0]
    assert v2["zero_stage"] == 3 and v2["param_shard_size"] == 2


def _init_error(config: dict) -> list:
    import smdistributed.modelparallel.torch as smp
    from smp2ds.translator.issues import SMPConfigError

    try:
        smp.init(config)
    except SMPConfigError as exc:
        return [(i.pointer, i.message, i.given) for i in exc.issues]
    return []


@pytest.mark.slow
def test_smp_init_refuses_what_explain_reports_unsupported_with_the_same_reason():
    from smp2ds.translator.tensor_parallel import TP_WITH_SDP_UNSUPPORTED

    # tp 2 x sdp 2 on 4 ranks (rdp 2 holds the shard groups) without prescaled_batch: refused with the reason
    config = {"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "horovod": False}
    per_rank = run_ranks(_init_error, 4, config)
    for issues in per_rank:
        assert issues == [("/tensor_parallel_degree",
                           f"tensor_parallel_degree is not supported: {TP_WITH_SDP_UNSUPPORTED}", 2)]
