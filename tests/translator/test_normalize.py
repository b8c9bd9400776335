"""normalize(): aliases resolved, every default filled, SMP's fix-ups, input shapes and pointers."""

from __future__ import annotations

import dataclasses

import pytest

from smp2ds.schemas import load_schema
from smp2ds.translator.issues import SMPConfigError
from smp2ds.translator.normalize import fixups, normalize
from smp2ds.translator.plan_types import Layout

P = "/distribution/smdistributed/modelparallel/parameters"
CANONICAL = set(load_schema("smp_v1")["properties"]) - {"partitions"}


def test_params_hold_every_canonical_key_with_defaults():
    config = normalize({})
    assert set(config.params) == CANONICAL and len(CANONICAL) == 44
    assert config.pipeline_parallel_degree == 1
    assert config.active_microbatches == 1
    assert config.optimize == "speed" and config.memory_weight == 0.8
    assert config.sdp_reduce_bucket_size == 500000000 and type(config.sdp_reduce_bucket_size) is int
    assert config.default_partition is None and config.ddp_port is None
    assert config.overlapping_allreduce is True
    assert dict(config.given) == {} and config.kind == "parameters" and config.strategy == "modelparallel"
    with pytest.raises(AttributeError, match="no key 'partitions'"):
        _ = config.partitions


def test_alias_is_resolved_but_pointer_keeps_the_users_spelling():
    config = normalize({"partitions": 4, "microbatches": 8})
    assert config.pipeline_parallel_degree == 4
    assert dict(config.given) == {"pipeline_parallel_degree": 4, "microbatches": 8}
    assert dict(config.pointers) == {"partitions": "/partitions", "microbatches": "/microbatches"}
    assert normalize({"partitions": 2, "pipeline_parallel_degree": 2}).pipeline_parallel_degree == 2


@pytest.mark.parametrize(
    "pp, microbatches, expected",
    [(1, 1, 1), (2, 12, 4), (4, 8, 6), (4, 3, 3), (8, 1, 1)],
)
def test_active_microbatches_default_is_clamped(pp, microbatches, expected):
    assert (
        normalize({"pipeline_parallel_degree": pp, "microbatches": microbatches}).active_microbatches
        == expected
    )


def test_pipeline_forced_interleaved_when_active_differs():
    config = normalize({"partitions": 2, "microbatches": 8, "pipeline": "simple"})
    assert config.active_microbatches == 4
    assert config.pipeline == "interleaved"
    assert config.given["pipeline"] == "simple"
    assert fixups(config) == [
        "pipeline: 'simple' was changed to 'interleaved' as SMP does (active_microbatches != microbatches)"
    ]
    kept = normalize({"partitions": 2, "microbatches": 4, "pipeline": "simple"})
    assert kept.pipeline == "simple" and fixups(kept) == []


def test_checkpoint_attentions_forced_off_with_pipeline():
    assert normalize({"partitions": 2, "checkpoint_attentions": True}).checkpoint_attentions is False
    assert normalize({"checkpoint_attentions": True}).checkpoint_attentions is True


def test_estimator_spec_fields_and_pointers():
    doc = {
        "instance_type": "ml.p4d.24xlarge",
        "instance_count": 2,
        "hyperparameters": {"epochs": 1},
        "distribution": {
            "smdistributed": {
                "modelparallel": {"enabled": True, "parameters": {"pipeline_parallel_degree": 2, "ddp": True}}
            },
            "mpi": {"enabled": True},
        },
    }
    config = normalize(doc)
    assert config.kind == "estimator" and config.smp_version == 1
    assert (config.instance_type, config.instance_count) == ("ml.p4d.24xlarge", 2)
    assert dict(config.hyperparameters) == {"epochs": 1}
    assert dict(config.mpi) == {"enabled": True, "custom_mpi_options": ""}
    assert config.pointers["ddp"] == P + "/ddp"


def test_distribution_dict_without_parameters_uses_defaults():
    config = normalize({"smdistributed": {"modelparallel": {"enabled": True}}, "mpi": {"enabled": True}})
    assert config.kind == "distribution" and config.params["pipeline_parallel_degree"] == 1


def test_dataparallel_becomes_plain_data_parallelism():
    config = normalize({"smdistributed": {"dataparallel": {"enabled": True, "custom_mpi_options": "-x A"}}})
    assert config.strategy == "dataparallel"
    assert config.ddp is True
    assert {k: v for k, v in config.params.items() if k != "ddp"} == {
        k: v for k, v in normalize({}).params.items() if k != "ddp"
    }
    assert dict(config.given) == {} and dict(config.pointers) == {}


@pytest.mark.parametrize("launcher", ["pytorchddp", "torch_distributed"])
def test_plain_ddp_launchers_are_data_parallel(launcher):
    config = normalize({launcher: {"enabled": True}})
    assert config.strategy == "dataparallel" and config.smp_version == 1


def test_smp_v2_through_torch_distributed():
    doc = {
        "distribution": {
            "torch_distributed": {"enabled": True},
            "smdistributed": {
                "modelparallel": {
                    "enabled": True,
                    "parameters": {"hybrid_shard_degree": 8, "tensor_parallel_degree": 4},
                }
            },
        }
    }
    config = normalize(doc)
    assert (config.kind, config.smp_version, config.strategy) == ("estimator", 2, "modelparallel")
    assert config.v2["hybrid_shard_degree"] == 8 and config.v2["context_parallel_degree"] == 1
    assert set(config.v2) == set(load_schema("smp_v2")["properties"])
    # The v1 view: TP means the same, data parallelism is always on.
    assert config.tensor_parallel_degree == 4 and config.ddp is True
    assert config.pointers["hybrid_shard_degree"] == P + "/hybrid_shard_degree"


def test_bare_v2_dict_recognised_by_v2_only_keys():
    config = normalize({"context_parallel_degree": 2, "hybrid_shard_degree": 4})
    assert (config.kind, config.smp_version) == ("smp_v2", 2)
    # Keys shared by v1 and v2 alone mean SMP v1.
    assert normalize({"tensor_parallel_degree": 2, "ddp": True}).smp_version == 1


def test_world_rules_checked_when_world_known():
    with pytest.raises(SMPConfigError) as err:
        normalize({"partitions": 2}, Layout(world_size=4))
    issue = err.value.issues[0]
    assert (issue.pointer, issue.message) == (
        "/ddp",
        (
            "world_size(4) > pipeline_parallel_degree(2) * tensor_parallel_degree(1) = 2: "
            "the 2 model replicas need ddp: true"
        ),
    )
    assert normalize({"partitions": 2}).pipeline_parallel_degree == 2  # world unknown: not checked


def test_config_is_frozen_and_normalizing_its_dict_is_idempotent():
    config = normalize({"partitions": 2, "microbatches": 8, "ddp": True, "placement_strategy": "spread"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.kind = "estimator"
    with pytest.raises(TypeError):
        config.params["ddp"] = False
    again = normalize(config.to_dict())
    assert dict(again.params) == dict(config.params)


def test_unusable_input_raises_with_issues():
    with pytest.raises(SMPConfigError) as err:
        normalize("partitions=2")
    assert err.value.issues[0].pointer == ""
