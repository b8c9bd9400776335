"""docs/configuration.md is generated from the schemas and the fate table, and the committed page is current."""

from __future__ import annotations

from smp2ds.schemas import load_schema
from smp2ds.translator.keymap import KEYMAP_V1, KEYMAP_V2
from smp2ds.translator.tools import docs_reference
from tests.docs.pages import ROOT

STALE = "docs/configuration.md is stale: run `python -m smp2ds.translator.tools.docs_reference --write` and commit it"


def test_committed_page_equals_the_generated_one():
    assert (ROOT / docs_reference.PAGE).read_text() == docs_reference.render(), STALE


def test_every_key_appears_with_every_fate_and_reason():
    page = docs_reference.render()
    for table in (KEYMAP_V1, KEYMAP_V2):
        for key, rules in table.items():
            assert f"### `{key}`" in page
            for rule in rules:
                assert rule.reason in page, (key, rule.reason)


def test_schema_facts_reach_the_page():
    page = docs_reference.render()
    v1 = load_schema("smp_v1")["properties"]
    assert v1["placement_strategy"]["description"] in page
    assert '`"cluster"`, `"spread"`' in page  # the enum
    for field in load_schema("estimator")["properties"]:
        assert f"| `{field}` |" in page


def test_every_keymap_condition_has_words():
    used = {rule.when for table in (KEYMAP_V1, KEYMAP_V2) for rules in table.values() for rule in rules}
    assert used <= set(docs_reference.WHEN)


def test_write_then_read_back(tmp_path):
    (tmp_path / "docs").mkdir()
    assert docs_reference.main(["--write", "--root", str(tmp_path)]) == 0
    assert (tmp_path / docs_reference.PAGE).read_text() == docs_reference.render()
