"""The fast yes/no schema check agrees with jsonschema (SMP's strict types) on valid and broken documents.

``schema_fast.is_valid`` lets valid documents skip importing jsonschema (CLI start-up). It must
never call a document valid that jsonschema rejects (that would hide issues), and it should call
valid what jsonschema accepts (else the fast path is useless). Checked on every input document
in the examples and test data, against all four schemas, and on broken variants: every value
replaced by values of other types and ranges, every key removed, an unknown key added to every
object.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smp2ds.schemas import SCHEMA_FILES
from smp2ds.translator.schema_check import validator_for
from smp2ds.translator.schema_fast import is_valid

ROOT = Path(__file__).resolve().parents[2]
REPLACEMENTS: list[Any] = [True, False, 0, 1, -1, 2, 3.0, 0.5, 1e9, 2**40, "1", "ml.p4d.24xlarge", "x", None, [], {}, [1]]


def documents() -> list[tuple[str, Any]]:
    paths = sorted((ROOT / "examples").rglob("*.json")) + sorted((ROOT / "tests" / "data").rglob("input.json"))
    found = []
    for path in paths:
        try:
            found.append((str(path.relative_to(ROOT)), json.loads(path.read_text(encoding="utf-8"))))
        except json.JSONDecodeError:  # deliberately malformed inputs
            continue
    return found


def jsonschema_valid(document: Any, name: str) -> bool:
    return next(iter(validator_for(name).iter_errors(document)), None) is None


def variants(document: Any) -> Iterator[Any]:
    """Broken (or not) copies of ``document``: one change each."""
    for path, value in _leaves(document, ()):
        for replacement in REPLACEMENTS:
            if replacement is not value:
                yield _replaced(document, path, replacement)
        if path:
            yield _replaced(document, path, _DELETE)
    for path in _objects(document, ()):
        yield _replaced(document, path + ("not_an_smp_key",), 1)


@pytest.mark.slow  # ~30 s on 2 cores for all inputs and variants; still runs in CI
@pytest.mark.parametrize(("source", "document"), documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_agrees_with_jsonschema(source, document):
    checked = disagreements = 0
    # variants are checked against the schemas the document itself is valid for (the others
    # reject it anyway, for reasons unrelated to the change); originals against all four
    schemas = [n for n in SCHEMA_FILES if jsonschema_valid(document, n)]
    for candidate, names in [(document, list(SCHEMA_FILES)), *((v, schemas) for v in variants(document))]:
        for name in names:
            fast = is_valid(candidate, name)
            slow = jsonschema_valid(candidate, name)
            assert not (fast is True and not slow), f"{source}: fast check accepts what {name} rejects: {candidate}"
            disagreements += fast is not True and slow
            checked += 1
    assert disagreements == 0, f"{source}: {disagreements} of {checked} valid documents sent to jsonschema"


def test_examples_take_the_fast_path():
    estimators = sorted((ROOT / "examples" / "configs").glob("*.json"))
    assert estimators
    for path in estimators:
        assert is_valid(json.loads(path.read_text(encoding="utf-8")), "estimator") is True, path


def test_exact_types():
    assert is_valid({"microbatches": 2}, "smp_v1") is True
    assert is_valid({"microbatches": True}, "smp_v1") is False  # a boolean is not an integer for SMP
    assert is_valid({"microbatches": 2.0}, "smp_v1") is False  # nor is a whole float


_DELETE = object()


def _leaves(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _leaves(item, path + (index,))


def _objects(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        yield path
        for key, item in value.items():
            yield from _objects(item, path + (key,))


def _replaced(document: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return copy.deepcopy(new)
    result = copy.deepcopy(document)
    parent = result
    for step in path[:-1]:
        parent = parent[step]
    if new is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return result
