"""``smp2ds explain`` shows smp2ds's own settings (SMP2DS_COMPILE) as such, never as SMP keys."""

from __future__ import annotations

import json

import pytest

from smp2ds.cli import main
from smp2ds.translator.smp2ds_settings import compile_requested


def _config(tmp_path):
    path = tmp_path / "smp.json"
    path.write_text(json.dumps({"ddp": True, "bf16": True}))
    return str(path)


def test_text_marks_compile_as_not_an_smp_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SMP2DS_COMPILE", "1")
    assert main(["explain", _config(tmp_path), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "smp2ds settings (environment variables, not SMP keys):" in out
    assert "SMP2DS_COMPILE  1      smp2ds setting (not an SMP key)" in out


def test_json_lists_it_and_nothing_without_it(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SMP2DS_COMPILE", raising=False)
    assert main(["explain", _config(tmp_path), "--world-size", "2", "--format", "json"]) == 0
    assert "smp2ds_settings" not in json.loads(capsys.readouterr().out)
    monkeypatch.setenv("SMP2DS_COMPILE", "0")
    assert main(["explain", _config(tmp_path), "--world-size", "2", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["smp2ds_settings"]
    assert rows[0]["name"] == "SMP2DS_COMPILE" and rows[0]["fate"] == "smp2ds setting (not an SMP key)"


@pytest.mark.parametrize(("value", "wanted"), [("1", True), ("0", False), (" 1 ", True)])
def test_values(value, wanted):
    assert compile_requested({"SMP2DS_COMPILE": value}) is wanted
    assert compile_requested({}) is False


def test_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="SMP2DS_COMPILE='on' is not one of 0, 1"):
        compile_requested({"SMP2DS_COMPILE": "on"})
