"""resolve_layout / check_world / the instance table: where each number comes from and SMP's world checks."""

from __future__ import annotations

import pytest

from smp2ds.translator.instances import gpus_for, known_instance_types, processes_for
from smp2ds.translator.normalize import analyse, normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.world_layout import ResolvedLayout, check_world, resolve_layout

P = "/distribution/smdistributed/modelparallel/parameters"


def estimator(params=None, itype="ml.p4d.24xlarge", count=2, ppn=None, hyper=None):
    mpi = {"enabled": True}
    if ppn is not None:
        mpi["processes_per_host"] = ppn
    doc = {
        "instance_type": itype,
        "instance_count": count,
        "distribution": {
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": params or {}}},
            "mpi": mpi,
        },
    }
    if hyper is not None:
        doc["hyperparameters"] = hyper
    return doc


@pytest.mark.parametrize(
    "itype, gpus",
    [
        ("ml.p3.2xlarge", 1),
        ("ml.p3.8xlarge", 4),
        ("ml.p3.16xlarge", 8),
        ("ml.p3dn.24xlarge", 8),
        ("ml.p4d.24xlarge", 8),
        ("ml.p4de.24xlarge", 8),
        ("ml.p5.48xlarge", 8),
        ("ml.g4dn.xlarge", 1),
        ("ml.g4dn.12xlarge", 4),
        ("ml.g4dn.metal", 8),
        ("ml.g5.2xlarge", 1),
        ("ml.g5.12xlarge", 4),
        ("ml.g5.24xlarge", 4),
        ("ml.g5.48xlarge", 8),
        ("ml.trn1.2xlarge", 2),
        ("ml.trn1.32xlarge", 32),
        ("ml.m5.xlarge", 0),
        ("ml.c5.18xlarge", 0),
        ("ml.c5n.9xlarge", 0),
        ("ml.r5.large", 0),
        ("ml.zz9.huge", None),
        ("p4d.24xlarge", None),
        (None, None),
    ],
)
def test_instance_table(itype, gpus):
    assert gpus_for(itype) == gpus
    assert processes_for(itype) == (None if gpus is None else max(gpus, 1))


def test_instance_table_lists_ml_types():
    names = known_instance_types()
    assert "ml.p4d.24xlarge" in names and all(n.startswith("ml.") for n in names)


def test_world_from_instance_count_and_gpus():
    resolved = resolve_layout(normalize(estimator({"ddp": True})))
    assert resolved == ResolvedLayout(
        world_size=16,
        ranks_per_node=8,
        nodes=2,
        gpus_per_instance=8,
        world_source="instance_count(2) x GPUs of ml.p4d.24xlarge(8)",
    )


def test_processes_per_host_beats_the_instance_table():
    resolved = resolve_layout(normalize(estimator({"ddp": True}, ppn=4)))
    assert (resolved.world_size, resolved.ranks_per_node, resolved.nodes) == (8, 4, 2)
    assert resolved.world_source == "instance_count(2) x processes_per_host(4)"


def test_explicit_layout_wins():
    config = normalize(estimator({"ddp": True}, ppn=8))
    resolved = resolve_layout(config, Layout(world_size=4, gpus_per_node=2, batch_size=6))
    assert (resolved.world_size, resolved.ranks_per_node, resolved.nodes) == (4, 2, 2)
    assert (resolved.batch_size, resolved.batch_source, resolved.world_source) == (6, "layout", "layout")
    # A world smaller than one node runs on one node.
    small = resolve_layout(config, Layout(world_size=2))
    assert (small.ranks_per_node, small.nodes) == (2, 1)


def test_unknown_world():
    resolved = resolve_layout(normalize({"partitions": 2}))
    assert resolved == ResolvedLayout()
    unknown_type = resolve_layout(normalize(estimator({"ddp": True}, itype="ml.zz9.huge")))
    assert unknown_type.world_size is None and unknown_type.gpus_per_instance is None


def test_cpu_instance_runs_one_process_per_host():
    resolved = resolve_layout(normalize(estimator({"ddp": True}, itype="ml.c5.xlarge", count=3)))
    assert (resolved.world_size, resolved.ranks_per_node, resolved.gpus_per_instance) == (3, 1, 0)


@pytest.mark.parametrize(
    "hyper, batch, source",
    [
        (
            {"per_device_train_batch_size": 16, "train_batch_size": 99},
            16,
            "hyperparameters.per_device_train_batch_size",
        ),
        ({"train_batch_size": 48}, 48, "hyperparameters.train_batch_size"),
        ({"batch_size": "32"}, 32, "hyperparameters.batch_size"),  # SageMaker passes strings
        ({"batch-size": 8}, 8, "hyperparameters.batch-size"),
        ({"train_batch_size": "big", "batch_size": 0}, None, None),
        ({"total_train_batch_size": 512}, None, None),
        ({"per_device_train_batch_size": True}, None, None),
    ],
)
def test_batch_size_from_hyperparameters(hyper, batch, source):
    resolved = resolve_layout(normalize(estimator({"ddp": True}, hyper=hyper)))
    assert (resolved.batch_size, resolved.batch_source) == (batch, source)


def test_check_world_prints_the_arithmetic():
    config = normalize({"partitions": 3, "ddp": True})
    issues = check_world(config, resolve_layout(config, Layout(world_size=8)))
    assert [(i.pointer, i.message, i.allowed) for i in issues] == [
        (
            "/partitions",
            "world_size(8) is not divisible by pipeline_parallel_degree(3) * tensor_parallel_degree(1) = 3",
            "a product that divides 8: 1, 2, 4, 8",
        )
    ]


def test_check_world_tensor_parallel_pointer_and_exceeding_product():
    config = normalize({"tensor_parallel_degree": 8, "ddp": True})
    issues = check_world(config, resolve_layout(config, Layout(world_size=4)))
    assert [(i.pointer, i.message) for i in issues] == [
        (
            "/tensor_parallel_degree",
            "pipeline_parallel_degree(1) * tensor_parallel_degree(8) = 8 exceeds world_size(4)",
        )
    ]


def test_check_world_replicas_need_ddp_points_where_ddp_goes():
    # analyse() builds the config despite its problems (normalize would raise on them).
    _, config = analyse(estimator({"partitions": 4}, itype="ml.p3.16xlarge", count=1))
    issues = check_world(config, resolve_layout(config))
    assert [(i.pointer, i.message) for i in issues] == [
        (
            P + "/ddp",
            (
                "world_size(8) > pipeline_parallel_degree(4) * tensor_parallel_degree(1) = 4: "
                "the 2 model replicas need ddp: true"
            ),
        )
    ]
    assert "instance_count(1) x GPUs of ml.p3.16xlarge(8)" in issues[0].hint


def test_horovod_also_satisfies_replicas():
    config = normalize({"partitions": 2, "horovod": True})
    assert check_world(config, resolve_layout(config, Layout(world_size=4))) == []


@pytest.mark.parametrize(
    "sdp, world, pp, message",
    [
        (
            3,
            8,
            1,
            (
                "sharded_data_parallel_degree(3) does not divide the data-parallel degree "
                "world_size(8) / pipeline_parallel_degree(1) = 8"
            ),
        ),
        (
            16,
            8,
            1,
            (
                "sharded_data_parallel_degree(16) exceeds the data-parallel degree "
                "world_size(8) / pipeline_parallel_degree(1) = 8"
            ),
        ),
    ],
)
def test_check_world_sharded_degree(sdp, world, pp, message):
    config = normalize({"sharded_data_parallel_degree": sdp, "ddp": True})
    issues = check_world(config, resolve_layout(config, Layout(world_size=world)))
    assert [(i.pointer, i.message) for i in issues] == [("/sharded_data_parallel_degree", message)]


def test_seed_002_sharding_fits_256_gpus():
    config = normalize(
        estimator(
            {"sharded_data_parallel_degree": 128, "ddp": True, "bf16": True, "partitions": 1}, count=32, ppn=8
        )
    )
    resolved = resolve_layout(config)
    assert (resolved.world_size, resolved.nodes) == (256, 32)
    assert check_world(config, resolved) == []


def test_processes_per_host_over_gpu_count():
    _, config = analyse(estimator({"ddp": True}, itype="ml.g5.12xlarge", count=1, ppn=8))
    issues = check_world(config, resolve_layout(config))
    assert [(i.pointer, i.message, i.hint) for i in issues] == [
        (
            "/distribution/mpi/processes_per_host",
            "processes_per_host(8) exceeds the 4 GPUs of ml.g5.12xlarge",
            "set `processes_per_host: 4`",
        )
    ]


def test_partial_last_node_is_reported():
    config = normalize({"ddp": True})
    issues = check_world(config, resolve_layout(config, Layout(world_size=6, gpus_per_node=4)))
    assert [(i.pointer, i.message) for i in issues] == [
        ("", "world_size(6) is not a multiple of the ranks per node (4)")
    ]


def test_batch_must_split_into_microbatches():
    config = normalize({"partitions": 2, "microbatches": 4, "ddp": True})
    issues = check_world(config, resolve_layout(config, Layout(world_size=2, batch_size=6)))
    assert [(i.pointer, i.message) for i in issues] == [
        ("/microbatches", "batch size(6) from layout is not divisible by microbatches(4)")
    ]
    assert check_world(config, resolve_layout(config, Layout(world_size=2, batch_size=8))) == []


def test_v2_degrees_checked_against_world():
    config = normalize({"hybrid_shard_degree": 16, "tensor_parallel_degree": 3})
    issues = check_world(config, resolve_layout(config, Layout(world_size=8)))
    assert [(i.pointer, i.message) for i in issues] == [
        ("/hybrid_shard_degree", "hybrid_shard_degree(16) exceeds world_size(8)"),
        ("/tensor_parallel_degree", "world_size(8) is not divisible by tensor_parallel_degree(3)"),
    ]


def test_dataparallel_has_no_model_parallel_world_rules():
    config = normalize({"smdistributed": {"dataparallel": {"enabled": True}}})
    assert check_world(config, resolve_layout(config, Layout(world_size=3))) == []
