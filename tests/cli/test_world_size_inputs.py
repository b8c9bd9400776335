"""How the CLI treats the world size, with the exact inputs a new user tried: ``validate`` of a bare parameter
dict (no world size) validates what it can and says what it did not check; ``--world_size`` gets the flag it
meant instead of the top-level usage; ``doctor`` takes ``--nnodes`` as ``launch`` does."""

from __future__ import annotations

import json

from smp2ds.cli import main


def test_validate_without_a_world_size_checks_the_rest(tmp_path, capsys):
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"ddp": True, "tensor_parallel_degree": 2, "microbatches": 2}))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid SMP configuration" in out and "world-size rules were not checked" in out
    assert "smallest world these degrees fit is 2" in out
    # what smp.init refuses is still found without a world size
    path.write_text(json.dumps({"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2}))
    assert main(["validate", str(path)]) == 1
    assert "prescaled_batch" in capsys.readouterr().out


def test_an_underscored_flag_is_answered_with_the_hyphenated_one(tmp_path, capsys):
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"ddp": True}))
    assert main(["validate", str(path), "--world_size", "8"]) == 2
    err = capsys.readouterr().err
    assert "unknown flag --world_size; did you mean --world-size?" in err


def test_doctor_takes_nnodes_like_launch(tmp_path, capsys):
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"ddp": True, "tensor_parallel_degree": 2}))
    reports = []
    for flag in ("--nnodes", "--nodes"):
        code = main(["doctor", "--config", str(path), flag, "2", "--world-size", "4", "--format", "json"])
        reports.append((code, capsys.readouterr().out))
    assert reports[0] == reports[1] and reports[0][0] in (0, 1)  # the same check under either spelling
    assert any(f["check"] == "--config" for f in json.loads(reports[0][1])["findings"])


def test_tensor_parallel_groups_that_leave_a_node_are_warned_about(tmp_path, capsys):
    """The estimator a new user moved: 4 nodes x 8, tp 8, placement_strategy spread (every group spans all four
    nodes); validate, explain and doctor all say so, and cluster placement is quiet."""
    spec = {"instance_type": "ml.p4d.24xlarge", "instance_count": 4,
            "distribution": {"mpi": {"enabled": True, "processes_per_host": 8}, "smdistributed": {"modelparallel": {
                "enabled": True, "parameters": {"ddp": True, "tensor_parallel_degree": 8,
                                                "placement_strategy": "spread"}}}}}
    path = tmp_path / "estimator.json"
    path.write_text(json.dumps(spec))
    warning = "spreads 4 of the 4 tensor-parallel groups over up to 4 nodes"
    assert main(["validate", str(path)]) == 0
    assert warning in capsys.readouterr().out
    assert main(["explain", str(path)]) == 0
    assert warning in capsys.readouterr().out
    main(["doctor", "--config", str(path), "--format", "json"])
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert any(f["check"] == "placement" and warning in f["detail"] for f in findings)
    spec["distribution"]["smdistributed"]["modelparallel"]["parameters"]["placement_strategy"] = "cluster"
    path.write_text(json.dumps(spec))
    assert main(["validate", str(path)]) == 0
    assert "warning" not in capsys.readouterr().out


def test_a_world_size_that_replaces_the_estimators_instances_is_said(tmp_path, capsys):
    spec = {"instance_type": "ml.p4d.24xlarge", "instance_count": 4,
            "distribution": {"mpi": {"enabled": True, "processes_per_host": 8}, "smdistributed": {"modelparallel": {
                "enabled": True, "parameters": {"ddp": True, "tensor_parallel_degree": 8}}}}}
    path = tmp_path / "estimator.json"
    path.write_text(json.dumps(spec))
    assert main(["validate", str(path), "--world-size", "16"]) == 0
    assert "the world size 16 given replaces the estimator's instance_count(4) x 8 processes = 32" in \
        capsys.readouterr().out
    assert main(["validate", str(path), "--world-size", "32"]) == 0
    assert "replaces" not in capsys.readouterr().out
