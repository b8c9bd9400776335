"""The key-fate table: complete, consistent with the schemas, and pointing at real plan settings."""

from __future__ import annotations

from typing import Any

import pytest

from smp2ds.schemas import load_schema
from smp2ds.translator import keymap as km
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan
from smp2ds.translator.semantics import v1_defaults

FATES = {"mapped", "engine", "ignored", "unsupported"}


def resolve(doc: dict[str, Any], pointer: str) -> Any:
    """Follow an RFC 6901 pointer; KeyError/IndexError when it does not exist."""
    node: Any = doc
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        node = node[int(token)] if isinstance(node, list) else node[token]
    return node


def make(params: dict[str, Any], world: int, gpus: int | None = None, batch: int | None = None):
    layout = Layout(world_size=world, gpus_per_node=gpus, batch_size=batch)
    return plan(normalize(params, layout), layout)


# One configuration per feature, so every conditional rule is exercised (see test below).
FEATURE_CONFIGS = {
    "pipeline": (
        {
            "partitions": 2,
            "microbatches": 4,
            "active_microbatches": 4,
            "ddp": True,
            "pipeline": "simple",
            "auto_partition": False,
            "default_partition": 1,
            "memory_weight": 0.5,
            "placement_strategy": "spread",
            "shard_optimizer_state": True,
            "offload_activations": True,
            "activation_loading_horizon": 2,
            "fp16": True,
            "ddp_port": 1234,
            "ddp_dist_backend": "nccl",
            "deterministic_server": True,
        },
        4,
        None,
    ),
    "tensor": (
        {
            "tensor_parallel_degree": 2,
            "ddp": True,
            "prescaled_batch": True,
            "optimize": "speed",
            "tensor_parallel_seed": 7,
            "bf16": True,
            "placement_strategy": "PTD",
            "pipeline_parallel_degree": 2,
            "_sharded_data_parallelism_config": "zero2d.json",
        },
        4,
        None,
    ),
    "sharded": (
        {
            "sharded_data_parallel_degree": 2,
            "ddp": True,
            "sdp_reduce_bucket_size": 1000,
            "sdp_param_persistence_threshold": 100,
            "sdp_max_live_parameters": 10000,
            "sdp_hierarchical_allgather": True,
            "sdp_gradient_clipping": 0.5,
            "delayed_parameter_initialization": True,
            "bf16": True,
        },
        4,
        1,
    ),
    "defaults": (
        {
            **{k: v for k, v in v1_defaults().items() if v is not None},
            "active_microbatches": 1,
            "partitions": 1,
        },
        1,
        None,
    ),
    "v2": (
        {
            "hybrid_shard_degree": 2,
            "tensor_parallel_degree": 1,
            "context_parallel_degree": 2,
            "expert_parallel_degree": 2,
            "random_seed": 3,
            "activation_loading_horizon": 3,
            "sm_activation_offloading": False,
            "fsdp_cache_flush_warnings": False,
            "allow_empty_shards": True,
        },
        4,
        None,
    ),
}


def test_v1_table_covers_exactly_the_v1_schema_keys():
    assert set(km.KEYMAP_V1) == set(load_schema("smp_v1")["properties"]) - set(km.META_KEYS)


def test_v2_table_covers_exactly_the_v2_schema_keys():
    assert set(km.KEYMAP_V2) == set(load_schema("smp_v2")["properties"]) - set(km.META_KEYS)


@pytest.mark.parametrize("version", [1, 2])
def test_every_key_has_a_complete_well_formed_rule_list(version):
    for key, rules in km.keymap(version).items():
        assert rules, key
        assert rules[-1].when == "always", f"{key}: the last rule must be unconditional"
        for rule in rules:
            assert rule.fate in FATES and rule.when in km.CONDITIONS, key
            assert rule.reason.strip(), f"{key}: every fate needs a reason"
            if rule.fate == "engine":
                assert rule.target and rule.target.startswith("/engine/"), key
            if rule.fate == "mapped":
                assert rule.target and not rule.target.startswith("/engine/"), key


def test_fate_counts_add_up_to_the_table():
    for version in (1, 2):
        counts = km.fate_counts(version)
        assert sum(counts.values()) == len(km.keymap(version))
        assert set(counts) == FATES


@pytest.mark.parametrize("name", sorted(FEATURE_CONFIGS))
def test_every_note_target_exists_in_the_plan(name):
    params, world, gpus = FEATURE_CONFIGS[name]
    p = make(params, world, gpus)
    doc = p.to_dict()
    assert {n.key for n in p.notes} == set(params)  # one note per given key, as spelled
    assert len(p.notes) == len(params)
    for note in p.notes:
        assert note.pointer == f"/{note.key}"
        if note.fate in ("mapped", "engine"):
            resolve(doc, note.target)  # raises if the pointer leads nowhere


def test_every_conditional_rule_is_reached_by_some_feature_config():
    reached: set[tuple[str, int]] = set()
    for params, world, gpus in FEATURE_CONFIGS.values():
        p = make(params, world, gpus)
        for note in p.notes:
            version = 2 if "hybrid_shard_degree" in params else 1
            rules = km.keymap(version)[note.key]
            reached |= {
                (note.key, i)
                for i, r in enumerate(rules)
                if (r.fate, r.target, r.reason) == (note.fate, note.target, note.reason)
            }
    feature_rules = {
        (key, 0)
        for key, rules in km.KEYMAP_V1.items()
        if rules[0].when in ("sdp", "pipeline", "tp", "offload", "not_null")
    }
    assert feature_rules <= reached, sorted(feature_rules - reached)


# Keys whose value is copied unchanged to their target.
DIRECT = {
    "microbatches",
    "sdp_reduce_bucket_size",
    "sdp_param_persistence_threshold",
    "sdp_max_live_parameters",
    "sdp_gradient_clipping",
    "fp16",
    "bf16",
    "offload_activations",
    "tensor_parallel_degree",
    "sharded_data_parallel_degree",
    "memory_weight",
    "active_microbatches",
    "ddp_port",
    "ddp_dist_backend",
    "tensor_parallel_seed",
    "activation_loading_horizon",
    "delayed_parameter_initialization",
    "prescaled_batch",
    "auto_partition",
    "default_partition",
    "partitions",
    "pipeline_parallel_degree",
    "random_seed",
    "hybrid_shard_degree",
}


@pytest.mark.parametrize("name", sorted(FEATURE_CONFIGS))
def test_direct_mappings_carry_the_users_value(name):
    params, world, gpus = FEATURE_CONFIGS[name]
    p = make(params, world, gpus)
    doc = p.to_dict()
    checked = 0
    for note in p.notes:
        if note.key in DIRECT and note.fate in ("mapped", "engine"):
            assert resolve(doc, note.target) == params[note.key], note.key
            checked += 1
    assert checked >= 1


def test_value_dependent_fates():
    p = make({"horovod": True}, 4)
    assert {n.key: n.fate for n in p.notes}["horovod"] == "unsupported"
    p = make({"horovod": False, "ddp": True, "sdp_reduce_bucket_size": 1000}, 4)
    fates = {n.key: n for n in p.notes}
    assert fates["horovod"].fate == "ignored"
    # sdp_* without sharded data parallelism: SMP ignores them, so must we (and say so)
    assert fates["sdp_reduce_bucket_size"].fate == "ignored"
    assert "sharded_data_parallel_degree > 1" in fates["sdp_reduce_bucket_size"].reason
    assert p.deepspeed["zero_optimization"] == {"stage": 0}


def test_placement_note_points_at_the_letters():
    p = make({"partitions": 2, "ddp": True, "placement_strategy": "spread"}, 4)
    note = {n.key: n for n in p.notes}["placement_strategy"]
    assert resolve(p.to_dict(), note.target) == "TPD"


def test_fate_of_unknown_key_is_none_and_meta_keys_are_ignored():
    assert km.fate_of("no_such_key", {}, 1) is None
    assert km.fate_of("$schema", {}, "https://example/smp_v1.schema.json").fate == "ignored"
