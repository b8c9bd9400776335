"""`class_repair_hook`: a repair reaches its class whatever state the class's module is in.

The three states transformers' modules are in when smp2ds's ``smdistributed`` is imported (not
imported yet, half-executed because it is the importer, complete) are rebuilt with small
generated modules; the real transformers import orders run in `test_hf_trainer_dist.py`.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

from smp2ds.engine.integrations.class_repair_hook import ClassRepair, install

REPAIRED: list[str] = []


def _repair(cls: type) -> None:
    cls.repaired = True
    REPAIRED.append(cls.__qualname__)


@pytest.fixture()
def package(tmp_path: Path, request: pytest.FixtureRequest):
    """A fresh importable package named after the test; its modules are removed afterwards."""
    name = f"repairpkg_{request.node.name}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    REPAIRED.clear()
    yield name, tmp_path / name
    sys.path.remove(str(tmp_path))
    for mod in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[mod]


def test_module_not_imported_yet_is_repaired_when_it_loads(package) -> None:
    name, folder = package
    (folder / "target.py").write_text("class Target:\n    repaired = False\n")
    install([ClassRepair(f"{name}.target", "Target", _repair)])
    assert f"{name}.target" not in sys.modules
    module = importlib.import_module(f"{name}.target")
    assert module.Target.repaired and REPAIRED == ["Target"]
    assert module.__loader__.get_source(f"{name}.target").startswith("class Target")  # tracebacks still work


def test_half_executed_importer_is_repaired_on_first_access(package) -> None:
    """The target module itself triggers the installation (as transformers' training_args
    imports smdistributed) before its class is defined."""
    name, folder = package
    (folder / "installer.py").write_text(
        "from smp2ds.engine.integrations.class_repair_hook import ClassRepair, install\n"
        "from tests.engine.integrations.test_class_repair_hook import _repair\n"
        f"install([ClassRepair('{name}.target', 'Target', _repair)])\n")
    (folder / "target.py").write_text(
        f"import {name}.installer\n"
        "SEEN_DURING_IMPORT = type(__import__('sys').modules[__name__]).__name__\n"
        "class Target:\n    repaired = False\n")
    target = importlib.import_module(f"{name}.target")
    assert target.SEEN_DURING_IMPORT == "_RepairOnFirstAccess"
    from_import = vars(importlib.import_module(name))["target"].Target
    assert from_import.repaired and REPAIRED == ["Target"]
    assert type(target) is types.ModuleType  # back to a plain module after the repair


def test_complete_module_is_repaired_at_once(package) -> None:
    name, folder = package
    (folder / "target.py").write_text("class Target:\n    repaired = False\n")
    module = importlib.import_module(f"{name}.target")
    repair = ClassRepair(f"{name}.target", "Target", _repair)
    install([repair])
    assert module.Target.repaired and REPAIRED == ["Target"]


def test_module_without_the_class_is_refused_by_name(package) -> None:
    name, folder = package
    (folder / "target.py").write_text("class Other:\n    pass\n")
    install([ClassRepair(f"{name}.target", "Target", _repair)])
    with pytest.raises(ImportError, match=rf"smp2ds: {name}\.target defines no Target; this transformers release "
                                          r"is not supported"):
        importlib.import_module(f"{name}.target")
