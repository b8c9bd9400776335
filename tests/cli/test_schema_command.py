"""``smp2ds schema`` and the schemas' ``$id`` URLs resolving from the installed package (offline)."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urljoin, urlparse
from urllib.request import url2pathname

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry

from smp2ds import schemas
from smp2ds.cli import main

ROOT = Path(__file__).resolve().parents[2]
GPT2_30B = ROOT / "examples" / "configs" / "gpt2_30b_sdp_002.json"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_listing_names_id_and_installed_file(capsys):
    code, out, _ = run(["schema", "--format", "json"], capsys)
    listed = json.loads(out)
    assert code == 0 and [row["name"] for row in listed] == list(schemas.SCHEMA_FILES)
    for row in listed:
        on_disk = json.loads(Path(row["path"]).read_text(encoding="utf-8"))
        assert on_disk["$id"] == row["id"] == f"https://smp2ds.dev/schemas/{schemas.SCHEMA_FILES[row['name']]}"
    code, text, _ = run(["schema"], capsys)
    assert text.splitlines()[0].split() == ["name", "$id", "file"] and "estimator.schema.json" in text


@pytest.mark.parametrize(
    "spelling", ["estimator", "estimator.schema.json", "https://smp2ds.dev/schemas/estimator.schema.json"]
)
def test_print_by_name_file_or_id(spelling, capsys):
    code, out, _ = run(["schema", "--print", spelling], capsys)
    path = Path(schemas.schema_path("estimator"))
    assert code == 0 and json.loads(out) == json.loads(path.read_text(encoding="utf-8"))
    assert run(["schema", "--path", spelling], capsys)[1] == f"{path}\n"


def test_unknown_schema_is_a_usage_error_naming_what_is_allowed(capsys):
    code, _, err = run(["schema", "--print", "smp_v3"], capsys)
    assert code == 2
    assert "unknown schema 'smp_v3'; expected one of smp_v1, distribution, estimator, smp_v2" in err


def test_ids_resolve_offline_through_the_package():
    """A stock validator with only ``retrieve`` finds estimator -> distribution -> smp_v1 by $id."""
    registry = Registry(retrieve=schemas.retrieve)
    validator = Draft202012Validator({"$ref": schemas.schema_id("estimator")}, registry=registry)
    document = json.loads(GPT2_30B.read_text(encoding="utf-8"))
    assert list(validator.iter_errors(document)) == []
    params = document["distribution"]["smdistributed"]["modelparallel"]["parameters"]
    params["sharded_data_parallel_degree"] = "128"  # a string where SMP wants an integer
    errors = list(validator.iter_errors(document))
    assert [list(e.absolute_path)[-1] for e in errors] == ["sharded_data_parallel_degree"]
    assert errors[0].validator == "type"  # the check lives in smp_v1.schema.json, two $refs away


@pytest.mark.parametrize("name", list(schemas.SCHEMA_FILES))
def test_relative_refs_resolve_both_by_id_and_as_sibling_files(name):
    schema = schemas.load_schema(name)
    for ref in _refs(schema):
        target_id = urljoin(schema["$id"], ref)
        assert schemas.load_schema(target_id)["$id"] == target_id.split("#")[0]
        beside = Path(schemas.schema_path(name)).parent / ref.split("#")[0]
        assert json.loads(beside.read_text(encoding="utf-8"))["$id"] == target_id.split("#")[0]


def test_vscode_snippet_points_at_the_installed_files(capsys):
    code, out, _ = run(["schema", "--vscode"], capsys)
    entries = json.loads(out)["json.schemas"]
    assert code == 0 and {e["url"].rsplit("/", 1)[-1] for e in entries} == set(schemas.SCHEMA_FILES.values())
    for entry in entries:
        url = urlparse(entry["url"])
        assert url.scheme == "file" and entry["fileMatch"]
        assert json.loads(Path(url2pathname(url.path)).read_text(encoding="utf-8"))["title"]


def _refs(value: object) -> list[str]:
    if isinstance(value, dict):
        found = [value["$ref"]] if isinstance(value.get("$ref"), str) else []
        return found + [r for v in value.values() for r in _refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    return []
