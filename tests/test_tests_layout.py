"""The tests mirror the source: ``tests/engine/<package>/`` for each engine package, the per-rank functions of the
multi-rank tests in ``tests/engine/workers/``, and nothing loose at ``tests/engine/`` but shared helpers."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "engine"
HELPER_FOLDERS = {"workers", "scripts", "__pycache__"}
SHARED_HELPERS = {"__init__.py", "hf_equivalence.py", "proc_launch.py", "runtime_fixtures.py"}
WHOLE_ENGINE_TESTS = {"test_engine_signatures.py"}
"""Tests of every package at once (what each engine function's signature takes)."""


def test_each_test_folder_is_an_engine_package():
    packages = {p.name for p in (ROOT / "engine").iterdir() if p.is_dir() and any(p.glob("*.py"))}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir()} - HELPER_FOLDERS
    assert folders <= packages, f"test folders without an engine package: {sorted(folders - packages)}"
    for folder in folders:
        assert (TESTS / folder / "__init__.py").exists(), folder


def test_workers_live_in_the_workers_folder_and_nothing_else_is_loose():
    loose = {p.name for p in TESTS.glob("*.py")} - SHARED_HELPERS - WHOLE_ENGINE_TESTS
    assert loose == set(), f"put these in the engine package's test folder or tests/engine/workers: {sorted(loose)}"
    misplaced = [str(p.relative_to(TESTS)) for p in TESTS.rglob("*_workers.py") if p.parent.name != "workers"]
    assert misplaced == []
    assert list((TESTS / "workers").glob("test_*.py")) == []
