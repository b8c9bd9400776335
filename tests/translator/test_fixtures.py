"""Golden cases, discovered by directory (CONTRIBUTING.md, convention 7).

valid/<case>/input.json must normalize; an optional expected.json pins fields of the result
(kind, strategy, smp_version, a subset of params / v2, the given keys and the resolved layout).
invalid/<case>/input.json must fail with exactly the issues in expected.issues.json: each entry
names the pointer and a substring of the message (and optionally of the hint). An optional
layout.json supplies a Layout. Inputs are read with load_document, so duplicate keys, malformed
JSON and `parameters` files are covered by the same cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smp2ds.translator.issues import SMPConfigError
from smp2ds.translator.load import load_document
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.validate import validate
from smp2ds.translator.world_layout import resolve_layout

DATA = Path(__file__).resolve().parents[1] / "data" / "smp"


def _cases(kind: str) -> list[Path]:
    return sorted(p for p in (DATA / kind).iterdir() if (p / "input.json").is_file())


def _layout(case: Path) -> Layout | None:
    path = case / "layout.json"
    return Layout(**json.loads(path.read_text())) if path.is_file() else None


def test_fixture_folders_exist():
    # Guards against a silently empty parametrisation (e.g. a moved data folder).
    assert len(_cases("valid")) >= 10
    assert len(_cases("invalid")) >= 30


@pytest.mark.parametrize("case", _cases("valid"), ids=lambda p: p.name)
def test_valid_case(case: Path):
    doc = load_document(str(case / "input.json"))
    layout = _layout(case)
    assert validate(doc, layout) == []
    config = normalize(doc, layout)
    expected_path = case / "expected.json"
    if not expected_path.is_file():
        return
    expected = json.loads(expected_path.read_text())
    for field in ("kind", "strategy", "smp_version"):
        if field in expected:
            assert getattr(config, field) == expected[field], field
    for key, value in expected.get("params", {}).items():
        assert config.params[key] == value, key
    for key, value in expected.get("v2", {}).items():
        assert config.v2[key] == value, key
    if "given_keys" in expected:
        assert sorted(config.given) == expected["given_keys"]
    resolved = resolve_layout(config, layout)
    for key, value in expected.get("layout", {}).items():
        assert getattr(resolved, key) == value, key


def _actual_issues(case: Path):
    try:
        doc = load_document(str(case / "input.json"))
    except SMPConfigError as err:
        return list(err.issues)
    layout = _layout(case)
    issues = validate(doc, layout)
    # normalize must refuse the same document with the same problems.
    with pytest.raises(SMPConfigError) as err:
        normalize(doc, layout)
    assert [(i.pointer, i.message) for i in err.value.issues] == [(i.pointer, i.message) for i in issues]
    return issues


@pytest.mark.parametrize("case", _cases("invalid"), ids=lambda p: p.name)
def test_invalid_case(case: Path):
    expected = json.loads((case / "expected.issues.json").read_text())
    actual = _actual_issues(case)
    shown = "\n".join(str(i) for i in actual)
    assert len(actual) == len(expected), f"expected {len(expected)} issues, got:\n{shown}"
    for want in expected:
        matches = [
            i
            for i in actual
            if i.pointer == want["pointer"]
            and want["message"] in i.message
            and ("hint" not in want or (i.hint is not None and want["hint"] in i.hint))
        ]
        assert matches, f"no issue like {want} in:\n{shown}"
