"""Apply a repair to a class of another package as soon as its module has defined it.

transformers imports ``smdistributed.modelparallel.torch`` from inside its own modules, so when
smp2ds installs its repairs a target module is in one of three states:

* not imported yet: a ``sys.meta_path`` finder wraps its loader, and the repair runs right after
  the module's code ran;
* half-executed (it is the module importing smp; its classes are defined further down): the
  module object's class is switched to one whose attribute lookup applies the repair on the first
  access from outside once the class exists. Nobody can obtain the class without such an access
  (``from m import C`` and ``m.C`` both read the module's attribute); the module's own code reads
  its globals directly and is unaffected. The switch is undone right after the repair;
* complete: the repair runs at once.

Repairs must be idempotent; each is applied at most once per class.
"""

from __future__ import annotations

import importlib.abc
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ClassRepair:
    """Run ``repair(cls)`` on class ``class_name`` of module ``module_name``."""

    module_name: str
    class_name: str
    repair: Callable[[type], None]

    def apply_if_defined(self, namespace: dict[str, Any]) -> bool:
        cls = namespace.get(self.class_name)
        if not isinstance(cls, type):
            return False
        self.repair(cls)
        return True


# Repairs waiting for a half-executed module, by module name.
_waiting: dict[str, list[ClassRepair]] = {}


class _RepairOnFirstAccess(types.ModuleType):
    """Class given to a half-executed module: its first attribute read after the target class
    exists applies the waiting repairs, then the module becomes a plain module again."""

    def __getattribute__(self, name: str) -> Any:
        namespace = types.ModuleType.__getattribute__(self, "__dict__")
        module_name = namespace.get("__name__")
        pending = _waiting.get(module_name, [])
        done = [r for r in pending if r.apply_if_defined(namespace)]
        if done:
            remaining = [r for r in pending if r not in done]
            if remaining:
                _waiting[module_name] = remaining
            else:
                _waiting.pop(module_name, None)
                self.__class__ = types.ModuleType
        return types.ModuleType.__getattribute__(self, name)


class _RepairingLoader(importlib.abc.Loader):
    """Delegates to the module's own loader, then applies the repairs."""

    def __init__(self, loader: Any, repairs: list[ClassRepair]):
        self._loader = loader
        self._repairs = repairs

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        for repair in self._repairs:
            if not repair.apply_if_defined(vars(module)):
                raise ImportError(f"smp2ds: {repair.module_name} defines no {repair.class_name}; this transformers "
                                  "release is not supported (see pyproject.toml for the supported range)")

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for inspect and tracebacks
        return getattr(self._loader, name)


class _RepairingFinder(importlib.abc.MetaPathFinder):
    """Finds target modules through the other finders and wraps their loaders."""

    def __init__(self) -> None:
        self.expected: dict[str, list[ClassRepair]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.expected:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _RepairingLoader(spec.loader, self.expected.pop(fullname))
        return spec


_finder = _RepairingFinder()


def install(repairs: list[ClassRepair]) -> None:
    """Apply each repair now, at the end of its module's execution, or on first use (see module doc)."""
    for repair in repairs:
        module = sys.modules.get(repair.module_name)
        if module is None:
            _finder.expected.setdefault(repair.module_name, [])
            if repair not in _finder.expected[repair.module_name]:
                _finder.expected[repair.module_name].append(repair)
        elif not repair.apply_if_defined(vars(module)):
            if repair not in _waiting.setdefault(repair.module_name, []):
                _waiting[repair.module_name].append(repair)
            if type(module) is types.ModuleType:
                module.__class__ = _RepairOnFirstAccess
    if _finder.expected and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
