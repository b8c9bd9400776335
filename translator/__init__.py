"""smp2ds translator: SMP configuration dicts -> validated `SMPConfig` -> `Plan`.

Pure functions, no torch or deepspeed import, so ``smp2ds validate/convert/explain`` start fast.
Public API: ``load_document``, ``validate``, ``normalize``, ``plan`` and the types below.
Names are resolved lazily so importing one piece does not import the others.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .issues import InputError, Issue, SMPConfigError
from .model import KeyNote, Layout, Plan, SMPConfig

_LAZY = {
    "load_document": ".load",
    "parse_json_text": ".load",
    "validate": ".validate",
    "normalize": ".normalize",
    "resolve_layout": ".layout",
    "ResolvedLayout": ".layout",
    "plan": ".planner",
}

__all__ = ["InputError", "Issue", "SMPConfigError", "KeyNote", "Layout", "Plan", "SMPConfig", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
