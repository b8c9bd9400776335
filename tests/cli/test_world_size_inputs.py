"""How the CLI treats the world size, with the exact inputs a new user tried: ``validate`` of a bare parameter
dict (no world size) validates what it can and says what it did not check; ``--world_size`` gets the flag it
meant instead of the top-level usage; ``doctor`` takes ``--nnodes`` as ``launch`` does."""

from __future__ import annotations

import json

from smp2ds.translator.cli import main


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
