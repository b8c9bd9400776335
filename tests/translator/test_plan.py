"""plan(): layout, batch, precision, ZeRO, pipeline/TP blocks, notes and errors."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from smp2ds.translator.issues import SMPConfigError
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout, SMPConfig
from smp2ds.translator.planner import plan
from smp2ds.translator.semantics import resolve_v1


def make(params: Any, world: int | None = None, gpus: int | None = None, batch: int | None = None):
    layout = Layout(world_size=world, gpus_per_node=gpus, batch_size=batch)
    return plan(normalize(params, layout), layout)


def notes_by_key(p) -> dict[str, Any]:
    return {n.key: n for n in p.notes}


# --- errors ---------------------------------------------------------------------------------------


def test_unknown_world_is_an_error_with_a_hint():
    cfg = normalize({"microbatches": 2})
    with pytest.raises(SMPConfigError, match="world size") as err:
        plan(cfg)
    (issue,) = err.value.issues
    assert issue.pointer == "" and "--world-size" in issue.hint


def test_world_not_divisible_names_the_key_the_user_wrote():
    cfg = normalize({"partitions": 3, "ddp": True})
    with pytest.raises(SMPConfigError) as err:
        plan(cfg, Layout(world_size=4))
    assert [i.pointer for i in err.value.issues] == ["/partitions"]
    assert "not divisible" in err.value.issues[0].message


def test_sharded_data_parallel_with_pipeline_is_refused_even_without_normalize():
    given = {"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2, "ddp": True}
    cfg = SMPConfig(params=resolve_v1(given), given=given, pointers={k: f"/{k}" for k in given})
    with pytest.raises(SMPConfigError, match="ZeRO stages 0 and 1") as err:
        plan(cfg, Layout(world_size=8))
    assert err.value.issues[0].pointer == "/sharded_data_parallel_degree"


def test_batch_not_divisible_by_microbatches_points_at_microbatches():
    cfg = normalize({"microbatches": 4, "ddp": True})
    with pytest.raises(SMPConfigError) as err:
        plan(cfg, Layout(world_size=2, batch_size=6))
    assert err.value.issues[0].pointer == "/microbatches"


# --- topology -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "placement, mp_groups, dp_groups",
    [
        # docs/smp-semantics.md#ranks-and-placement, the SMP docs table: 8 GPUs, 2 partitions, no TP
        ("cluster", [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2, 4, 6], [1, 3, 5, 7]]),
        ("spread", [[0, 4], [1, 5], [2, 6], [3, 7]], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_topology_matches_smps_documented_groups(placement, mp_groups, dp_groups):
    p = make({"partitions": 2, "ddp": True, "placement_strategy": placement}, 8)
    topo = p.topology
    assert (topo["pipeline_parallel_degree"], topo["rdp_degree"], topo["dp_degree"], topo["mp_degree"]) == (
        2,
        4,
        4,
        2,
    )
    assert topo["groups"]["mp"] == mp_groups
    assert sorted(topo["groups"]["dp"]) == dp_groups
    assert p.engine["placement"]["order"] == {"cluster": "DPT", "spread": "TPD"}[placement]


def test_large_worlds_give_counts_not_listings():
    p = make({"sharded_data_parallel_degree": 8, "ddp": True}, 128, gpus=8)
    assert p.topology["groups"] is None and "shard_groups" not in p.topology
    mics = p.engine["mics"]
    assert mics["shard_groups"] is None and mics["replica_groups"] is None
    assert (mics["shard_group_count"], mics["replica_group_count"], mics["replicas"]) == (16, 8, 16)
    assert p.topology["nodes"] == 16 and p.topology["ranks_per_node"] == 8


def test_shard_and_replica_groups_on_four_ranks():
    p = make({"sharded_data_parallel_degree": 2, "ddp": True}, 4, gpus=2)
    assert p.topology["shard_groups"] == [[0, 1], [2, 3]]
    assert p.topology["replica_groups"] == [[0, 2], [1, 3]]
    assert p.engine["mics"]["shard_groups"] == [[0, 1], [2, 3]]
    assert (p.topology["sharded_data_parallel_degree"], p.topology["replicas"]) == (2, 2)


@pytest.mark.parametrize(
    "shard, gpus, requested, expected, nodes_per_group",
    [(4, 2, True, True, 2), (2, 2, True, False, 1), (4, 2, False, False, 2), (4, 4, True, False, 1)],
)
def test_hierarchical_allgather_only_when_a_shard_group_spans_nodes(
    shard, gpus, requested, expected, nodes_per_group
):
    p = make(
        {"sharded_data_parallel_degree": shard, "ddp": True, "sdp_hierarchical_allgather": requested},
        8,
        gpus=gpus,
    )
    mics = p.engine["mics"]
    assert mics["hierarchical_allgather"] is expected
    assert mics["nodes_per_shard_group"] == nodes_per_group
    switched_off = any("switched off" in r for r in p.remarks)
    assert switched_off == (requested and nodes_per_group == 1)


# --- batch ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, world, batch, micro, tbs, ds_dp, global_batch",
    [
        ({"microbatches": 2, "ddp": True}, 4, 8, 4, 32, 4, 32),
        # prescaled_batch false: the TP group's batches are gathered -> micro is tp x B/m
        ({"microbatches": 2, "ddp": True, "tensor_parallel_degree": 2}, 4, 4, 4, 16, 2, 16),
        (
            {"microbatches": 2, "ddp": True, "tensor_parallel_degree": 2, "prescaled_batch": True},
            4,
            4,
            2,
            8,
            2,
            8,
        ),
        # sharded: DeepSpeed's data-parallel group is the shard group (2 ranks)
        ({"sharded_data_parallel_degree": 2, "ddp": True}, 4, 4, 4, 8, 2, 16),
        ({"partitions": 2, "microbatches": 4, "ddp": True}, 8, 8, 2, 32, 4, 32),
    ],
)
def test_batch_triple(params, world, batch, micro, tbs, ds_dp, global_batch):
    p = make(params, world, batch=batch)
    ds = p.deepspeed
    m = params.get("microbatches", 1)
    assert (
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
        ds["train_batch_size"],
    ) == (micro, m, tbs)
    # DeepSpeed's own rule, with the data-parallel size it will see
    assert ds["train_batch_size"] == micro * m * p.engine["batch"]["deepspeed_data_parallel_size"]
    assert p.engine["batch"]["deepspeed_data_parallel_size"] == ds_dp
    assert p.engine["batch"]["global_batch_size"] == global_batch


def test_unknown_batch_emits_only_accumulation_and_says_why():
    p = make({"microbatches": 3, "ddp": True}, 2)
    assert "train_batch_size" not in p.deepspeed and "train_micro_batch_size_per_gpu" not in p.deepspeed
    assert p.deepspeed["gradient_accumulation_steps"] == 3
    assert any("missing because the per-rank batch size is unknown" in r for r in p.remarks)


def test_batch_from_hyperparameters_of_an_estimator():
    doc = {
        "instance_type": "ml.p3.16xlarge",
        "instance_count": 1,
        "hyperparameters": {"train_batch_size": 48},
        "distribution": {
            "mpi": {"enabled": True, "processes_per_host": 8},
            "smdistributed": {
                "modelparallel": {
                    "enabled": True,
                    "parameters": {"partitions": 2, "microbatches": 12, "ddp": True},
                }
            },
        },
    }
    p = plan(normalize(doc))
    assert (
        p.deepspeed["train_micro_batch_size_per_gpu"] == 4 and p.deepspeed["train_batch_size"] == 4 * 12 * 4
    )
    assert p.engine["batch"]["source"] == "hyperparameters.train_batch_size"


# --- DeepSpeed blocks -----------------------------------------------------------------------------


def test_fp16_uses_smp_dynamic_scaler_defaults_and_no_clipping():
    ds = make({"fp16": True, "ddp": True}, 2).deepspeed
    assert ds["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 32,
        "loss_scale_window": 1000,
        "hysteresis": 1,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    }
    assert ds["bf16"] == {"enabled": False}
    assert ds["gradient_clipping"] == 0.0


def test_bf16_and_fp32_blocks_are_explicit():
    # the speed switches are written out too (smp2ds.translator.bf16_settings; tests/translator/test_bf16_settings.py)
    assert make({"bf16": True}, 1).deepspeed["bf16"] == {"enabled": True, "check_grad_overflow": True,
                                                          "immediate_grad_update": False}
    ds = make({}, 1).deepspeed
    assert ds["fp16"] == {"enabled": False} and ds["bf16"] == {"enabled": False}


@pytest.mark.parametrize(
    "params, stage",
    [
        ({"ddp": True}, 0),
        ({"ddp": True, "shard_optimizer_state": True}, 1),
        ({"ddp": True, "sharded_data_parallel_degree": 2}, 3),
    ],
)
def test_zero_stage(params, stage):
    ds = make(params, 4).deepspeed
    assert ds["zero_optimization"]["stage"] == stage
    assert ds.get("zero_allow_untested_optimizer", False) is (stage > 0)


def test_sharded_data_parallel_zero3_block_carries_the_sdp_knobs():
    ds = make(
        {
            "ddp": True,
            "sharded_data_parallel_degree": 2,
            "sdp_reduce_bucket_size": 1234,
            "sdp_param_persistence_threshold": 55,
            "sdp_max_live_parameters": 777,
            "sdp_gradient_clipping": 0.25,
        },
        4,
    ).deepspeed
    zero = ds["zero_optimization"]
    assert (
        zero["reduce_bucket_size"],
        zero["stage3_param_persistence_threshold"],
        zero["stage3_max_live_parameters"],
    ) == (1234, 55, 777)
    assert zero["contiguous_gradients"] is False and zero["overlap_comm"] is True
    assert not any(k.startswith("mics") for k in zero)
    assert ds["gradient_clipping"] == 0.25


def test_pipeline_and_tensor_parallel_blocks_only_when_used():
    flat = make({"ddp": True}, 2).deepspeed
    assert "pipeline" not in flat and "tensor_parallel" not in flat
    both = make({"partitions": 2, "tensor_parallel_degree": 2, "ddp": True}, 4).deepspeed
    assert set(both["pipeline"]) == {
        "activation_checkpoint_interval",
        "pipe_partitioned",
        "grad_partitioned",
        "use_reentrant",
    }
    # No AutoTP block: the engine shards the model itself, DeepSpeed's AutoTP is not used.
    assert "tensor_parallel" not in both
    tp = notes_by_key(make({"tensor_parallel_degree": 2, "ddp": True}, 2))["tensor_parallel_degree"]
    assert tp.fate == "engine" and tp.target == "/engine/tensor_parallel/degree"
    with_pp = notes_by_key(make({"partitions": 2, "tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": True,
                                 "tensor_parallel_seed": 3}, 4))
    assert with_pp["tensor_parallel_degree"].fate == "engine"
    assert with_pp["prescaled_batch"].fate == with_pp["tensor_parallel_seed"].fate == "engine"
    # each tensor-parallel rank's activations are its own: DeepSpeed must not split them over the group
    assert both["pipeline"]["pipe_partitioned"] is both["pipeline"]["grad_partitioned"] is False
    alone = make({"partitions": 2, "ddp": True}, 2).deepspeed["pipeline"]
    assert alone["pipe_partitioned"] is alone["grad_partitioned"] is True


def test_offload_activations_is_run_by_the_engine_with_its_horizon():
    p = make({"offload_activations": True, "activation_loading_horizon": 2}, 1)
    assert p.deepspeed["activation_checkpointing"]["cpu_checkpointing"] is True
    assert p.engine["activation_checkpointing"]["offload"] is True
    assert p.engine["activation_checkpointing"]["loading_horizon"] == 2
    fates = notes_by_key(p)
    assert fates["offload_activations"].fate == fates["activation_loading_horizon"].fate == "engine"
    assert "CPU memory" in fates["offload_activations"].reason
    off = notes_by_key(make({"offload_activations": False, "activation_loading_horizon": 2}, 1))
    assert off["offload_activations"].fate == off["activation_loading_horizon"].fate == "ignored"


# --- pipeline engine section ------------------------------------------------------------------------


def test_pipeline_schedules_and_smps_fixup():
    simple = make(
        {"partitions": 2, "microbatches": 4, "active_microbatches": 4, "pipeline": "simple", "ddp": True}, 4
    ).engine["pipeline"]
    assert simple["schedule"] == "gpipe" and simple["stages"] == 2 and simple["enabled"]
    forced = make(
        {"partitions": 2, "microbatches": 4, "active_microbatches": 2, "pipeline": "simple", "ddp": True}, 4
    )
    assert forced.engine["pipeline"]["schedule"] == "1f1b"
    assert any("pipeline" in r and "interleaved" in r for r in forced.remarks)


# --- notes ------------------------------------------------------------------------------------------


def test_notes_use_the_users_spelling_and_pointer_inside_an_estimator():
    doc = {
        "instance_type": "ml.p3.16xlarge",
        "instance_count": 1,
        "distribution": {
            "mpi": {"enabled": True, "processes_per_host": 8},
            "smdistributed": {
                "modelparallel": {
                    "enabled": True,
                    "parameters": {"partitions": 2, "ddp": True, "microbatches": 1},
                }
            },
        },
    }
    notes = notes_by_key(plan(normalize(doc)))
    assert set(notes) == {"partitions", "ddp", "microbatches"}
    assert notes["partitions"].pointer == "/distribution/smdistributed/modelparallel/parameters/partitions"
    assert notes["partitions"].target == "/engine/pipeline/stages"
    # a key set to its default still gets its note
    assert notes["microbatches"].value == 1 and notes["microbatches"].fate == "mapped"


def test_data_parallel_input_is_plain_data_parallelism():
    doc = {
        "instance_type": "ml.p3.16xlarge",
        "instance_count": 2,
        "hyperparameters": {"per_device_train_batch_size": 4},
        "distribution": {"smdistributed": {"dataparallel": {"enabled": True}}},
    }
    p = plan(normalize(doc))
    assert p.topology["world_size"] == 16 and p.deepspeed["zero_optimization"] == {"stage": 0}
    assert p.deepspeed["train_batch_size"] == 64
    assert "SM_HP_MP_PARAMETERS" not in p.launcher["env"]
    assert json.loads(p.launcher["env"]["SM_FRAMEWORK_PARAMS"])["sagemaker_distributed_dataparallel_enabled"]
    assert any("plain data parallelism" in r for r in p.remarks)
    assert p.notes == ()


def test_smp_v2_hybrid_shard_degree_means_shard_size():
    p = make({"hybrid_shard_degree": 2}, 8)
    assert (p.engine["mics"]["shard_size"], p.engine["mics"]["replicas"]) == (2, 4)
    assert p.deepspeed["zero_optimization"]["stage"] == 3
    full = make({"hybrid_shard_degree": 0, "tensor_parallel_degree": 2}, 8)
    assert full.engine["mics"]["shard_size"] == 4  # 0 = every rank holding the same tensor slice
    assert "tensor_parallel" not in full.deepspeed
    none = make({"hybrid_shard_degree": 1}, 8)
    assert none.deepspeed["zero_optimization"]["stage"] == 0
    cp = notes_by_key(make({"hybrid_shard_degree": 2, "context_parallel_degree": 2}, 8))
    assert cp["context_parallel_degree"].fate == "unsupported"
    assert cp["hybrid_shard_degree"].fate == "engine"


# --- whole-plan properties ------------------------------------------------------------------------------


def test_plan_is_json_and_deterministic():
    params = {"partitions": 2, "tensor_parallel_degree": 2, "ddp": True, "fp16": True, "microbatches": 2}
    a = make(params, 8, gpus=4, batch=4).to_dict()
    b = make(params, 8, gpus=4, batch=4).to_dict()
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert set(a) == {"topology", "deepspeed", "engine", "megatron", "launcher", "notes"}


def test_planning_imports_neither_torch_nor_deepspeed():
    code = (
        "import sys\n"
        "from smp2ds.translator.normalize import normalize\n"
        "from smp2ds.translator.planner import plan\n"
        "from smp2ds.translator.tools.estimate import estimate\n"
        "from smp2ds.translator.plan_types import Layout\n"
        "lay = Layout(world_size=8, gpus_per_node=4, batch_size=8)\n"
        "p = plan(normalize({'sharded_data_parallel_degree': 4, 'ddp': True, 'fp16': True}, lay), lay)\n"
        "estimate(p, 1e9)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
