"""Every document the repository names exists in it, and the docs' opening examples run.

* Each ``*.md`` a source file, script, config or page mentions (``docs/smp-semantics.md``,
  ``bench/README.md``, a Markdown link ``[x](pipelines.md#section)``, an image) must resolve to a
  file of the tree: relative to the citing file, to the repository root or to ``docs/``. An
  ``#anchor`` into a Markdown file must be one of its headings (GitHub's slugs, as
  ``tests/docs/pages.py`` computes them).
* The notes the project was first written against were never part of the repository; a
  citation of them points a reader at nothing, so their names are refused outright.
* The pages this test owns (doctor, diagrams, smp-semantics) open with a ``bash`` block whose
  ``smp2ds`` commands are run (``tests/docs/test_pages.py`` runs the other pages' examples).

Files are those git tracks or would track (``git ls-files --cached --others --exclude-standard``),
so build outputs and virtual environments are not scanned.
"""

from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.docs.pages import anchors as page_anchors
from tests.docs.pages import opening_example, smp2ds_commands

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".sh", ".toml", ".json", ".yaml", ".yml", ".txt", ".cfg", ".ini"}
# Written as fragments so this file does not cite them itself.
RETIRED = re.compile(r"\b(?:" + "|".join(["design", "style"]) + r")\.md\b|\b(?:"
                     + "|".join(["smp-" + "config", "smp-" + "torch-api", "mapping-" + "anchors"]) + r")\b")
MD_REF = re.compile(r"(?<![\w/.{-])([A-Za-z0-9_][A-Za-z0-9_./-]*\.md)(#[A-Za-z0-9_-]+)?\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")


@cache
def tree() -> tuple[Path, ...]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    return tuple(ROOT / p for p in sorted(set(out)) if (ROOT / p).is_file())


def scanned() -> list[Path]:
    # This file names missing pages on purpose (its self-check) and spells the retired names in pieces.
    return [p for p in tree() if (p.suffix in SUFFIXES or p.parent.name == ".ci") and p != Path(__file__).resolve()]


@cache
def anchors(page: Path) -> frozenset[str]:
    return frozenset(page_anchors(page.read_text(encoding="utf-8")))


def resolve(citing: Path, target: str) -> Path | None:
    for base in (citing.parent, ROOT, ROOT / "docs"):
        path = (base / target).resolve()
        if path.is_file() or path.is_dir():
            return path
    return None


def broken_references(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{number}"
        if RETIRED.search(line):
            problems.append(f"{where}: cites {RETIRED.search(line).group(0)!r}, which is not part of the repository; "
                            "point at docs/smp-semantics.md, docs/internals.md or CONTRIBUTING.md")
        line = URL.sub("", line)
        refs = [(m.group(1), m.group(2)) for m in MD_REF.finditer(line)]
        if path.suffix == ".md":
            for target in LINK.findall(line):
                file, _, anchor = target.partition("#")
                if file and not target.startswith(("mailto:",)):
                    refs.append((file, f"#{anchor}" if anchor else None))
        for file, anchor in dict.fromkeys(refs):  # a Markdown link is also a *.md token: check it once
            found = resolve(path, file)
            if found is None:
                problems.append(f"{where}: {file} does not exist in the tree")
            elif anchor and found.suffix == ".md" and anchor[1:] not in anchors(found):
                problems.append(f"{where}: {file} has no heading for {anchor}")
    return problems


@pytest.mark.parametrize("path", scanned(), ids=lambda p: str(p.relative_to(ROOT)))
def test_references_resolve(path):
    assert broken_references(path) == []


def test_the_checker_sees_a_retired_name_a_missing_file_and_a_missing_anchor(tmp_path):
    # The check itself must be able to fail (a page outside the tree resolves through root and docs/).
    page = tmp_path / "probe.md"
    page.write_text("See [gone](no-such-page.md), [here](smp-semantics.md#no-such-section) and\n"
                    "[ok](smp-semantics.md#ranks-and-placement); also `translator/nowhere.md`.\n"
                    f"As {'mapping-' + 'anchors'} section 1.2 says.\n")
    found = broken_references(page)
    assert len(found) == 4, found
    assert "probe.md:1: no-such-page.md does not exist in the tree" in found
    assert "probe.md:1: smp-semantics.md has no heading for #no-such-section" in found
    assert "probe.md:2: translator/nowhere.md does not exist in the tree" in found
    assert found[-1].startswith("probe.md:3: cites")


@pytest.mark.parametrize("page", ["doctor.md", "diagrams.md", "smp-semantics.md"])
def test_opening_example_runs(page, tmp_path):
    pytest.importorskip("matplotlib")  # diagrams.md draws
    language, body = opening_example((ROOT / "docs" / page).read_text(encoding="utf-8"))
    commands = smp2ds_commands(body)
    assert language == "bash" and commands
    for command in commands:
        argv = [str(ROOT / a) if a.startswith("examples/") else a for a in command.argv]
        proc = subprocess.run([sys.executable, "-m", "smp2ds.cli", *argv], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        # doctor may find problems on the machine running the tests (exit 1); anything else is a failure.
        assert proc.returncode in ((0, 1) if argv[0] == "doctor" else (0,)), proc.stderr
        assert proc.stdout.strip()
        for name in (a for a in argv if a.endswith((".png", ".svg"))):
            assert (tmp_path / name).stat().st_size > 1000
