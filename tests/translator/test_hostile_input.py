"""The CLI on hostile input: huge, deeply nested or malformed documents and bad environment knobs
end quickly with exit 1 (or 2 for a bad knob) and a message naming the problem, never a
RecursionError, a traceback or minutes of work. (The engine's timeout knobs are checked in
tests/engine/diagnostics/test_faults_dist.py.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from smp2ds.cli import main
from smp2ds.translator.load import MAX_DEPTH, MAX_KEYS


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str, float]:
    start = time.perf_counter()
    code = main(argv)
    elapsed = time.perf_counter() - start
    out, err = capsys.readouterr()
    return code, out, err, elapsed


def test_millions_of_keys_are_refused_in_seconds_with_a_short_report(tmp_path: Path, capsys):
    path = tmp_path / "huge.json"
    path.write_text("{" + ",".join(f'"k{i}":{i}' for i in range(1_000_000)) + "}")
    code, out, err, elapsed = _run(["validate", str(path)], capsys)
    assert code == 1, err
    assert "has 1000000 keys, more than any SMP configuration could use" in out
    assert f"at most {MAX_KEYS} keys in one document" in out
    assert len(out.splitlines()) < 10
    # 2-4 s on an idle core (parsing); was > 300 s for 2.5 M keys: one problem with a difflib hint per key
    assert elapsed < 60, elapsed


def test_many_unknown_keys_under_the_limit_list_the_first_and_count_the_rest(tmp_path: Path, capsys):
    path = tmp_path / "many.json"
    path.write_text(json.dumps({"microbatches": 2, **{f"unknown_{i}": i for i in range(5000)}}))
    code, out, _, elapsed = _run(["validate", str(path)], capsys)
    assert code == 1
    assert "/: 5000 unknown SMP parameters; the first 50 are listed, 4950 more are not" in out
    assert "/unknown_49: unknown SMP parameter" in out and "/unknown_50:" not in out
    assert len(out.splitlines()) < 300
    assert elapsed < 20, elapsed


@pytest.mark.parametrize("command", ["validate", "convert", "explain"])
def test_ten_thousand_levels_of_nesting_are_a_clear_exit_1(tmp_path: Path, capsys, command):
    path = tmp_path / "deep.json"
    path.write_text('{"ddp": ' + '{"a": ' * 10_000 + "1" + "}" * 10_000 + "}")
    code, out, err, _ = _run([command, str(path)], capsys)
    text = out + err
    assert code == 1, text
    assert "nests objects/arrays too deeply for the JSON reader" in text
    assert f"at most {MAX_DEPTH} levels of nesting" in text
    assert "RecursionError" not in text and "internal error" not in text


def test_nesting_beyond_the_limit_points_at_where_it_starts(tmp_path: Path, capsys):
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({"microbatches": 2, "ddp": _nest(200)}))
    code, out, _, _ = _run(["validate", str(path)], capsys)
    assert code == 1
    assert f"/ddp/a/a/...: {path} nests objects/arrays more than {MAX_DEPTH} levels deep" in out


def _nest(levels: int) -> object:
    node: object = 1
    for _ in range(levels):
        node = {"a": node}
    return node


def test_launch_config_errors_name_the_file(tmp_path: Path, capsys):
    config = tmp_path / "params.json"
    config.write_text(json.dumps({"microbatchez": 2}))
    code, _, err, _ = _run(["launch", "--config", str(config), "--nproc-per-node", "2", "--dry-run", "--",
                            "t.py"], capsys)
    assert code == 1
    assert err.startswith(f"{config}: invalid SMP configuration"), err
    assert "input:" not in err


def test_a_bad_gpu_count_knob_is_named(tmp_path: Path, capsys, monkeypatch):
    config = tmp_path / "params.json"
    config.write_text(json.dumps({"ddp": True}))
    monkeypatch.setenv("SMP2DS_NUM_GPUS", "two")
    code, _, err, _ = _run(["launch", "--config", str(config), "--dry-run", "--", "t.py"], capsys)
    assert code == 2
    assert "SMP2DS_NUM_GPUS='two' is not a GPU count" in err


def test_the_text_report_shows_the_first_problems_and_counts_the_rest():
    from smp2ds.cli.report import MAX_ISSUES_SHOWN, render_issues_text
    from smp2ds.translator.issues import Issue

    issues = [Issue(f"/k{i}", "must be an integer", given="x") for i in range(MAX_ISSUES_SHOWN + 37)]
    text = render_issues_text(issues, "doc.json")
    assert text.startswith(f"doc.json: invalid SMP configuration ({MAX_ISSUES_SHOWN + 37} problems)")
    assert f"/k{MAX_ISSUES_SHOWN - 1}: must be an integer" in text and f"/k{MAX_ISSUES_SHOWN}:" not in text
    assert text.rstrip().endswith("... and 37 more problems (not shown; fix these first)")
