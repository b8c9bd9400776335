"""validate(): schema + cross-key rules, every problem at once, each with pointer, value, allowed and hint."""

from __future__ import annotations

import io
import json

import pytest

from smp2ds.translator.issues import InputError, SMPConfigError
from smp2ds.translator.load import load_document, parse_json_text
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.schema_check import spell_float, type_hint
from smp2ds.translator.validate import validate

P = "/distribution/smdistributed/modelparallel/parameters"


def estimator(params, **more):
    doc = {
        "instance_type": "ml.p3.16xlarge",
        "instance_count": 1,
        "distribution": {
            "smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
            "mpi": {"enabled": True, "processes_per_host": 8},
        },
    }
    doc.update(more)
    return doc


def only(issues):
    assert len(issues) == 1, "\n".join(map(str, issues))
    return issues[0]


# --- exact SMP types --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message, hint",
    [
        ("microbatches", 4.5, "must be an integer, not a float", "whole number"),
        ("microbatches", 4.0, "must be an integer, not a float", "write 4 (an int), not 4.0"),
        (
            "sdp_reduce_bucket_size",
            5e8,
            "must be an integer, not a float",
            "write 500000000 (an int), not 5e8",
        ),
        (
            "sdp_max_live_parameters",
            1.5e9,
            "must be an integer, not a float",
            "write 1500000000 (an int), not 1.5e9",
        ),
        ("partitions", "2", "must be an integer, not a string", "write 2 without quotes"),
        (
            "sdp_reduce_bucket_size",
            "5e8",
            "must be an integer, not a string",
            "write 500000000 (an int) without quotes",
        ),
        ("microbatches", True, "must be an integer, not a boolean", "not accept true/false as an integer"),
        ("memory_weight", 1, "must be a float, not an integer", "write 1.0"),
        ("sdp_gradient_clipping", 1, "must be a float, not an integer", "write 1.0"),
        ("memory_weight", "0.3", "must be a float, not a string", "write 0.3 without quotes"),
        ("ddp", "true", "must be a boolean (true or false), not a string", "write true (a JSON boolean)"),
        ("ddp", 1, "must be a boolean (true or false), not an integer", "write true (a JSON boolean), not 1"),
        ("pipeline", 2, 'must be one of "interleaved", "simple", "_only_forward"', None),
        ("default_partition", "0", "must be an integer or null, not a string", "write 0 without quotes"),
    ],
)
def test_exact_types(key, value, message, hint):
    issue = only(validate({key: value}))
    assert issue.pointer == f"/{key}"
    assert issue.message == message
    assert issue.given == value
    if hint is None:
        assert issue.hint is None
    else:
        assert hint in issue.hint


def test_type_errors_point_into_the_estimator_spec():
    issue = only(validate(estimator({"partitions": 1, "microbatches": 2.0})))
    assert issue.pointer == P + "/microbatches"
    assert "write 2 (an int), not 2.0" in issue.hint


def test_spell_float_reconstructs_exponent_notation():
    assert spell_float(5e8) == "5e8"
    assert spell_float(1e6) == "1e6"
    assert spell_float(1.5e9) == "1.5e9"
    assert spell_float(4.0) == "4.0"
    assert type_hint(3, ["string"]) is None


# --- unknown and misplaced keys ------------------------------------------------------------------


def test_unknown_key_did_you_mean():
    issue = only(validate({"microbatch": 4}))
    assert issue.pointer == "/microbatch"
    assert issue.message == "unknown SMP parameter `microbatch`"
    assert issue.hint.startswith("did you mean `microbatches`")
    assert "smp_v1.schema.json" in issue.allowed


def test_unknown_key_case_and_dashes_forgiven_in_hint():
    issue = only(validate({"Pipeline-Parallel-Degree": 2}))
    assert issue.hint == "did you mean `pipeline_parallel_degree`?"


@pytest.mark.parametrize(
    "doc, pointer, hint",
    [
        (
            {
                "smdistributed": {
                    "modelparallel": {"enabled": True, "parameters": {"processes_per_host": 8}}
                },
                "mpi": {"enabled": True},
            },
            "/smdistributed/modelparallel/parameters/processes_per_host",
            "`processes_per_host` belongs under `mpi`",
        ),
        (
            estimator({"custom_mpi_options": "-x A=1"}),
            P + "/custom_mpi_options",
            "`custom_mpi_options` belongs under `distribution.mpi`",
        ),
        (
            estimator({}, microbatches=4),
            "/microbatches",
            "`microbatches` belongs under `distribution.smdistributed.modelparallel.parameters`",
        ),
        (
            {
                "mpi": {"enabled": True},
                "smdistributed": {"modelparallel": {"enabled": True}},
                "instance_count": 2,
                "partitions": 2,
            },
            "/partitions",
            "belongs under `distribution.smdistributed.modelparallel.parameters`",
        ),
        (
            {"processes_per_host": 8, "partitions": 1},
            "/processes_per_host",
            "the estimator's `distribution.mpi`, not the SMP parameters",
        ),
        (
            {
                "smdistributed": {"modelparallel": {"enabled": True}},
                "mpi": {"enabled": True, "parameters": {}},
            },
            "/mpi/parameters",
            "`parameters` belongs under `smdistributed.modelparallel`",
        ),
    ],
)
def test_misplaced_keys_name_their_home(doc, pointer, hint):
    issues = [i for i in validate(doc) if i.pointer == pointer]
    assert only(issues).hint.startswith(hint) or hint in only(issues).hint


def test_estimator_unknown_key_and_pattern():
    doc = {
        "instance_counts": 2,
        "instance_type": "p3.16xlarge",
        "distribution": {"smdistributed": {"dataparallel": {"enabled": True}}},
    }
    issues = validate(doc)
    assert [(i.pointer, i.message) for i in issues] == [
        ("/instance_counts", "unknown key `instance_counts`"),
        ("/instance_type", "must be an instance type like ml.p4d.24xlarge"),
    ]
    assert issues[0].hint == "did you mean `instance_count`?"
    assert issues[1].hint == "write ml.p3.16xlarge"


def test_enum_lists_allowed_values():
    issue = only(validate({"optimize": "fast"}))
    assert issue.pointer == "/optimize"
    assert issue.message == 'must be one of "speed", "memory"'
    assert issue.allowed == '"speed", "memory"'


def test_missing_required_key_points_where_it_should_be():
    issue = only(validate({"smdistributed": {"modelparallel": {"parameters": {}}}, "mpi": {"enabled": True}}))
    assert issue.pointer == "/smdistributed/modelparallel/enabled"
    assert issue.message == "missing required key `enabled`"
    assert not issue.has_given


def test_not_an_object():
    issue = only(validate([1, 2]))
    assert issue.pointer == ""
    assert issue.message.startswith("expected a JSON object")


# --- cross-key rules (docs/smp-semantics.md#cross-key-rules) ---------------------------------------------


@pytest.mark.parametrize(
    "params, key, message",
    [
        (
            {"partitions": 2, "pipeline_parallel_degree": 4},
            "partitions",
            "conflicting values: partitions(2) and pipeline_parallel_degree(4)",
        ),
        (
            {"tensor_parallel_degree": 2},
            "tensor_parallel_degree",
            "tensor_parallel_degree(2) > 1 requires ddp: true",
        ),
        ({"ddp": True, "horovod": True}, "horovod", "ddp and horovod cannot both be true"),
        ({"ddp_port": 1234}, "ddp_port", "ddp_port requires ddp: true"),
        ({"ddp_dist_backend": "nccl"}, "ddp_dist_backend", "ddp_dist_backend requires the `ddp` key"),
        ({"auto_partition": False}, "auto_partition", "auto_partition: false requires default_partition"),
        (
            {"partitions": 2, "default_partition": 3},
            "default_partition",
            "default_partition(3) must be < pipeline_parallel_degree(2)",
        ),
        (
            {"microbatches": 2, "active_microbatches": 3},
            "active_microbatches",
            "active_microbatches(3) must be <= microbatches(2)",
        ),
        (
            {"prescaled_batch": True, "optimize": "memory"},
            "prescaled_batch",
            'prescaled_batch: true requires optimize: "speed" (given optimize: "memory")',
        ),
        ({"bf16": True, "fp16_params": True}, "bf16", "bf16: true cannot be combined with fp16_params: true"),
        (
            {"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2},
            "sharded_data_parallel_degree",
            "sharded_data_parallel_degree(2) > 1 cannot be combined with pipeline_parallel_degree(2) > 1",
        ),
        (
            {"sharded_data_parallel_degree": 4, "shard_optimizer_state": True, "ddp": True},
            "sharded_data_parallel_degree",
            "sharded_data_parallel_degree(4) > 1 cannot be combined with shard_optimizer_state: true",
        ),
        (
            {"_fp32_grad_accumulation": True},
            "_fp32_grad_accumulation",
            "_fp32_grad_accumulation: true requires fp16: true or fp16_params: true",
        ),
        (
            {"shard_optimizer_state": True},
            "shard_optimizer_state",
            "shard_optimizer_state: true requires ddp: true",
        ),
        (
            {"shard_optimizer_state": True, "ddp": True, "overlapping_allreduce": False},
            "shard_optimizer_state",
            "shard_optimizer_state: true requires overlapping_allreduce: true",
        ),
        ({"herring": True, "ddp": True}, "herring", "herring: true requires ddp: false and horovod: false"),
    ],
)
def test_semantic_rule(params, key, message):
    issue = only(validate(params))
    assert issue.pointer == f"/{key}"
    assert issue.message.startswith(message)
    # The same rule points into an estimator spec when the dict sits there.
    nested = [
        i
        for i in validate(
            estimator(
                {**params, "ddp": params.get("ddp", True)} if key == "tensor_parallel_degree" else params
            )
        )
        if i.message.startswith(message)
    ]
    if key != "tensor_parallel_degree":
        assert only(nested).pointer == f"{P}/{key}"


@pytest.mark.parametrize(
    "params",
    [
        {"tensor_parallel_degree": 1},  # requires* only fire when the value differs from the default
        {"prescaled_batch": False, "optimize": "memory"},
        {"auto_partition": True},
        {"bf16": False, "fp16": True},
        {"ddp_dist_backend": "auto", "ddp": False},
        {"sharded_data_parallel_degree": 1, "pipeline_parallel_degree": 2},
        {"partitions": 2, "pipeline_parallel_degree": 2},
        {"auto_partition": False, "default_partition": 0},
        {"sharded_data_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True},  # SMP 1.15
    ],
)
def test_rules_do_not_fire_on_defaults_or_consistent_values(params):
    assert validate(params) == []


def test_alias_conflict_names_the_alias_spelling_in_rules():
    issue = only(validate({"partitions": 2, "auto_partition": False, "default_partition": 5}))
    assert issue.pointer == "/default_partition"
    assert "pipeline_parallel_degree(2)" in issue.message


# --- distribution rules -------------------------------------------------------------------------


def test_modelparallel_needs_mpi():
    issue = only(validate({"smdistributed": {"modelparallel": {"enabled": True}}, "mpi": {"enabled": False}}))
    assert issue.pointer == "/mpi/enabled"
    assert issue.given is False
    assert "`mpi.enabled` must be true" in issue.message
    assert "torch_distributed" in issue.hint


def test_modelparallel_with_torch_distributed_is_v2_and_needs_no_mpi():
    doc = {"torch_distributed": {"enabled": True}, "smdistributed": {"modelparallel": {"enabled": True}}}
    assert validate(doc) == []
    doc["mpi"] = {"enabled": True}
    issue = only(validate(doc))
    assert (issue.pointer, issue.message) == (
        "/mpi/enabled",
        "SMP v2 launches with `torch_distributed`; `mpi` cannot be enabled as well",
    )


def test_disabled_strategy_and_empty_distribution():
    issue = only(validate({"smdistributed": {"dataparallel": {"enabled": False}}}))
    assert issue.pointer == "/smdistributed/dataparallel/enabled"
    assert "disabled" in issue.message
    issues = validate({"distribution": {}})
    assert [(i.pointer, i.message) for i in issues] == [
        ("/distribution", "the distribution enables no strategy or launcher")
    ]


def test_smdistributed_needs_exactly_one_strategy():
    issue = only(validate({"smdistributed": {}, "mpi": {"enabled": True}}))
    assert issue.pointer == "/smdistributed"
    assert issue.message == "must contain exactly one of `modelparallel`, `dataparallel`"


# --- world size ------------------------------------------------------------------------------------


def test_world_checks_use_the_layout_over_the_estimator():
    doc = estimator({"partitions": 2, "ddp": True})
    assert validate(doc) == []
    # world 6 on one 8-GPU node: 3 replicas of a 2-stage pipeline, fine.
    assert validate(doc, Layout(world_size=6)) == []
    issue = only(validate(doc, Layout(world_size=5)))
    assert issue.pointer == P + "/partitions"
    assert (
        issue.message
        == "world_size(5) is not divisible by pipeline_parallel_degree(2) * tensor_parallel_degree(1) = 2"
    )
    assert issue.hint.startswith("start a multiple of 2 processes")
    assert issue.hint.endswith("world_size comes from layout")


def test_world_checks_skip_when_a_degree_was_rejected():
    # A rejected partitions value must not also produce arithmetic made with its default.
    issues = validate(estimator({"partitions": "3"}))
    assert [i.pointer for i in issues] == [P + "/partitions"]


# --- loading -------------------------------------------------------------------------------------


def test_duplicate_keys_are_reported_at_their_pointer():
    text = '{"a": {"b": 1, "b": 2, "c": [{"d": 1, "d": 1}]}, "a~/x": 1, "a~/x": 2}'
    with pytest.raises(SMPConfigError) as err:
        parse_json_text(text, source="cfg.json")
    assert [i.pointer for i in err.value.issues] == ["/a/b", "/a/c/0/d", "/a~0~1x"]
    assert err.value.issues[0].message == "duplicate key `b` in cfg.json: JSON keeps only the last value"


def test_malformed_json_reports_line_and_column():
    with pytest.raises(SMPConfigError) as err:
        parse_json_text('{\n  "a": 1,\n  "b": \n}', source="cfg.json")
    issue = only(err.value.issues)
    assert issue.pointer == ""
    assert "malformed JSON in cfg.json at line 4 column 1" in issue.message


def test_nan_is_not_json():
    with pytest.raises(SMPConfigError) as err:
        parse_json_text('{"memory_weight": NaN}')
    assert "NaN is not valid JSON" in only(err.value.issues).message


def test_python_dict_pasted_gets_a_hint():
    with pytest.raises(SMPConfigError) as err:
        parse_json_text("{'partitions': 2}")
    assert "double quotes" in only(err.value.issues).hint


def test_load_document_reads_stdin_and_reports_missing_files(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO('{"partitions": 2}'))
    assert load_document("-") == {"partitions": 2}
    with pytest.raises(InputError, match="cannot read"):
        load_document(str(tmp_path / "missing.json"))


def test_parameters_file_relative_to_document(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "smp.json").write_text('{"partitions": 2, "ddp": true}')
    (tmp_path / "est.json").write_text(json.dumps(estimator("conf/smp.json")))
    doc = load_document(str(tmp_path / "est.json"))
    assert doc["distribution"]["smdistributed"]["modelparallel"]["parameters"] == {
        "partitions": 2,
        "ddp": True,
    }
    assert normalize(doc).pointers["partitions"] == P + "/partitions"


def test_parameters_file_errors_point_into_the_whole_document(tmp_path):
    (tmp_path / "smp.json").write_text('{"partitions": 2,\n "partitions": 3}')
    (tmp_path / "est.json").write_text(json.dumps(estimator("smp.json")))
    with pytest.raises(SMPConfigError) as err:
        load_document(str(tmp_path / "est.json"))
    assert only(err.value.issues).pointer == P + "/partitions"


def test_string_parameters_in_a_dict_resolve_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "smp.json").write_text('{"partitions": 2, "ddp": true, "microbatchez": 2}')
    monkeypatch.chdir(tmp_path)
    issue = only(validate(estimator("smp.json")))
    assert issue.pointer == P + "/microbatchez"
    monkeypatch.chdir("/")
    issue = only(validate(estimator("smp.json")))
    assert issue.pointer == P
    assert issue.message.startswith("cannot read the parameters file")


def test_everything_at_once():
    doc = estimator(
        {
            "microbatch": 4,
            "memory_weight": 1,
            "pipeline": "gpipe",
            "tensor_parallel_degree": 2,
            "partitions": 3,
            "bf16": True,
            "fp16": True,
        },
        instance_counts=1,
    )
    pointers = [i.pointer for i in validate(doc)]
    assert pointers == sorted(pointers)
    assert set(pointers) == {
        "/instance_counts",
        P + "/microbatch",
        P + "/memory_weight",
        P + "/pipeline",
        P + "/tensor_parallel_degree",
        P + "/bf16",
        P + "/partitions",
    }
    with pytest.raises(SMPConfigError) as err:
        normalize(doc)
    assert len(err.value.issues) == len(pointers)
    assert "7 problems" in str(err.value)
