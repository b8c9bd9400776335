"""docs/troubleshooting.md explains every error class a user can meet: a new class fails here until it is listed."""

from __future__ import annotations

import ast

import pytest

from smp2ds.engine import exceptions
from tests.docs.pages import DOCS, ROOT


def _translator_errors() -> set[str]:
    """Public exception classes defined anywhere in translator/ and in the CLI (cli/)."""
    names = set()
    for path in [*(ROOT / "translator").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error") and not node.name.startswith("_"):
                names.add(node.name)
    return names


ERRORS = sorted(set(exceptions.__all__) | _translator_errors())


def test_the_translator_errors_are_found():
    assert {"SMPConfigError", "InputError", "UsageError"} <= set(ERRORS)


@pytest.mark.parametrize("name", ERRORS)
def test_error_is_explained(name):
    page = (DOCS / "troubleshooting.md").read_text()
    assert f"| `{name}`" in page, f"docs/troubleshooting.md has no row for {name}"


def test_the_ten_mistakes_are_listed():
    page = (DOCS / "troubleshooting.md").read_text()
    section = page.split("## The ten likely first-hour mistakes")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| Mistake")]
    assert len(rows) - 1 >= 10  # minus the |---| line
