"""The JSON Schemas themselves: well-formed draft 2020-12, complete against the reference, self-consistent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from smp2ds.schemas import SCHEMA_FILES, load_schema
from smp2ds.translator.schema_check import registry, validator_for

# Every name of SMP's parameter tables (docs/smp-semantics.md#parameters), the alias `partitions` and
# `overlapping_allreduce` (a DistributedModel argument that seed 000 passes as a parameter).
# Written out from the reference, not derived from the schema, so a dropped key fails here.
REFERENCE_V1_KEYS = {
    # 2.1 degrees, pipeline, partitioning
    "pipeline_parallel_degree",
    "partitions",
    "tensor_parallel_degree",
    "sharded_data_parallel_degree",
    "microbatches",
    "active_microbatches",
    "pipeline",
    "placement_strategy",
    "optimize",
    "auto_partition",
    "default_partition",
    "memory_weight",
    "contiguous",
    "skip_tracing",
    "load_partition",
    "partition_file",
    "deterministic_server",
    "fast_mode",
    "static_mode",
    # 2.2 data parallelism
    "ddp",
    "horovod",
    "ddp_port",
    "ddp_dist_backend",
    "herring",
    # 2.3 memory
    "shard_optimizer_state",
    "offload_activations",
    "activation_loading_horizon",
    "task_level_activation_loading_horizon",
    "_shard_offloaded_activations",
    "delayed_parameter_initialization",
    "prescaled_batch",
    "checkpoint_attentions",
    # 2.4 precision
    "fp16",
    "bf16",
    "fp16_params",
    "_fp32_grad_accumulation",
    "tensor_parallel_seed",
    # 2.5 sharded data parallelism
    "sdp_reduce_bucket_size",
    "sdp_param_persistence_threshold",
    "sdp_max_live_parameters",
    "sdp_hierarchical_allgather",
    "sdp_gradient_clipping",
    "_sharded_data_parallelism_config",
    # 2.6 internal
    "_match_weights",
    # seed 000
    "overlapping_allreduce",
}
REFERENCE_V2_KEYS = {
    "hybrid_shard_degree",
    "sm_activation_offloading",
    "activation_loading_horizon",
    "fsdp_cache_flush_warnings",
    "allow_empty_shards",
    "tensor_parallel_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
    "random_seed",
}
SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"


def _properties(schema):
    """Every (path, property schema) of a schema, recursively through nested objects."""
    for name, prop in schema.get("properties", {}).items():
        yield name, prop
        yield from ((f"{name}.{n}", p) for n, p in _properties(prop))


def test_v1_keys_match_the_reference():
    assert len(REFERENCE_V1_KEYS) == 45
    assert set(load_schema("smp_v1")["properties"]) == REFERENCE_V1_KEYS


def test_v2_keys_match_the_reference():
    assert set(load_schema("smp_v2")["properties"]) == REFERENCE_V2_KEYS


@pytest.mark.parametrize("name", sorted(SCHEMA_FILES))
def test_schema_is_valid_draft_2020_12(name):
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"https://smp2ds.dev/schemas/{SCHEMA_FILES[name]}"
    assert schema["title"] and schema["description"]
    # The file on disk is the package data the loader reads (editors open the same file).
    assert json.loads((SCHEMA_DIR / SCHEMA_FILES[name]).read_text()) == schema


@pytest.mark.parametrize("name", sorted(SCHEMA_FILES))
def test_every_property_is_documented(name):
    for path, prop in _properties(load_schema(name)):
        if "$ref" in prop:
            continue
        assert prop.get("title"), path
        assert prop.get("description"), path
        if name != "estimator" or path != "sagemaker_session":
            assert "type" in prop, path


@pytest.mark.parametrize("name", ["smp_v1", "smp_v2"])
def test_smp_keys_carry_annotations_and_valid_defaults(name):
    schema = load_schema(name)
    validator = validator_for(name)
    for key, prop in schema["properties"].items():
        assert prop["x-smp-framework"] in ("PT", "TF", "both"), key
        if "x-smp-internal" in prop:
            assert isinstance(prop["x-smp-internal"], bool), key
        if "default" in prop and prop["default"] is not None:
            # Each default passes our own strict per-key validation (e.g. 5e8 stored as an int);
            # cross-key rules (a lone ddp_dist_backend wants `ddp`) are not about the default.
            errors = [
                e for e in validator.iter_errors({key: prop["default"]}) if "x-smp-rule" not in e.schema
            ]
            assert errors == [], key


def test_v1_defaults_follow_the_reference():
    props = load_schema("smp_v1")["properties"]
    expected = {
        "pipeline_parallel_degree": 1,
        "tensor_parallel_degree": 1,
        "microbatches": 1,
        "pipeline": "interleaved",
        "placement_strategy": "cluster",
        "optimize": "speed",
        "auto_partition": True,
        "memory_weight": 0.8,
        "ddp": False,
        "horovod": False,
        "activation_loading_horizon": 4,
        "sdp_reduce_bucket_size": 500000000,
        "sdp_param_persistence_threshold": 1000000,
        "sdp_max_live_parameters": 1000000000,
        "sdp_hierarchical_allgather": True,
        "sdp_gradient_clipping": 1.0,
        "_shard_offloaded_activations": True,
        "overlapping_allreduce": True,
        "tensor_parallel_seed": 0,
        "contiguous": True,
    }
    for key, value in expected.items():
        assert props[key]["default"] == value and type(props[key]["default"]) is type(value), key
    assert "default" not in props["partitions"]  # an alias has no default of its own
    internal = {k for k, p in props.items() if p.get("x-smp-internal")}
    assert {
        "fast_mode",
        "static_mode",
        "herring",
        "_match_weights",
        "checkpoint_attentions",
        "_shard_offloaded_activations",
        "task_level_activation_loading_horizon",
        "_fp32_grad_accumulation",
        "_sharded_data_parallelism_config",
        "load_partition",
        "partition_file",
    } == internal


def test_enums_and_ranges():
    props = load_schema("smp_v1")["properties"]
    assert props["pipeline"]["enum"] == ["interleaved", "simple", "_only_forward"]
    assert set(props["placement_strategy"]["enum"]) == {
        "cluster",
        "spread",
        "DPT",
        "DTP",
        "PDT",
        "PTD",
        "TDP",
        "TPD",
    }
    assert props["optimize"]["enum"] == ["speed", "memory"]
    for key in (
        "pipeline_parallel_degree",
        "partitions",
        "tensor_parallel_degree",
        "microbatches",
        "active_microbatches",
        "sharded_data_parallel_degree",
    ):
        assert props[key]["minimum"] == 1, key
    assert (props["memory_weight"]["minimum"], props["memory_weight"]["maximum"]) == (0.0, 1.0)
    assert load_schema("smp_v1")["additionalProperties"] is False


def test_cross_file_refs_resolve_offline():
    # The estimator schema reaches smp_v1 through distribution: an error deep inside the
    # parameters proves both $refs resolved from our registry (no network is available).
    doc = {
        "distribution": {
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"microbatches": 0}}},
            "mpi": {"enabled": True},
        }
    }
    errors = list(validator_for("estimator").iter_errors(doc))
    assert [list(e.absolute_path) for e in errors] == [
        ["distribution", "smdistributed", "modelparallel", "parameters", "microbatches"]
    ]
    ids = {load_schema(n)["$id"] for n in SCHEMA_FILES}
    assert ids <= set(registry())


def test_strict_types_hold_behind_refs():
    # 4.0 is an integer for stock jsonschema; ours must reject it behind two $refs as well.
    doc = {
        "distribution": {
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"microbatches": 4.0}}},
            "mpi": {"enabled": True},
        }
    }
    assert Draft202012Validator(load_schema("smp_v1")).is_valid({"microbatches": 4.0})
    errors = list(validator_for("estimator").iter_errors(doc))
    assert [e.validator for e in errors] == ["type"]


def test_v2_parameters_use_the_v2_schema_under_torch_distributed():
    doc = {
        "torch_distributed": {"enabled": True},
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"hybrid_shard_degree": 8}}},
    }
    assert list(validator_for("distribution").iter_errors(doc)) == []
    doc["torch_distributed"]["enabled"] = False
    errors = list(validator_for("distribution").iter_errors(doc))
    assert [e.validator for e in errors] == ["additionalProperties"]


def test_schema_rules_are_annotated_for_semantics():
    # Every cross-key rule in the v1 schema is tagged so schema_check.py leaves it to semantics.py.
    rules = load_schema("smp_v1")["allOf"]
    assert {r["x-smp-rule"] for r in rules} == {
        "ddp-horovod-exclusive",
        "tp-needs-ddp",
        "ddp-knobs-need-ddp",
        "manual-partition-needs-default",
        "prescaled-needs-speed",
        "bf16-excludes-fp16",
    }
    validator = Draft202012Validator(load_schema("smp_v1"))
    assert not validator.is_valid({"ddp": True, "horovod": True})
    assert not validator.is_valid({"tensor_parallel_degree": 2})
    assert not validator.is_valid({"ddp_port": 1234})
    assert not validator.is_valid({"auto_partition": False})
    assert not validator.is_valid({"prescaled_batch": True, "optimize": "memory"})
    assert not validator.is_valid({"bf16": True, "fp16": True})
    assert validator.is_valid({"tensor_parallel_degree": 2, "ddp": True, "bf16": True})


@pytest.mark.parametrize("name", sorted(SCHEMA_FILES))
def test_documents_may_name_their_schema_for_editors(name):
    # `"$schema": "<url>"` at the top of a config lets editors validate and complete it.
    # It is a patternProperty so the property set stays exactly SMP's keys.
    schema = load_schema(name)
    assert schema["patternProperties"]["^\\$schema$"]["type"] == "string"
    assert "$schema" not in schema["properties"]
    doc = {"$schema": schema["$id"]}
    if name == "estimator":
        doc["distribution"] = {"smdistributed": {"dataparallel": {"enabled": True}}}
    assert list(validator_for(name).iter_errors(doc)) == []
