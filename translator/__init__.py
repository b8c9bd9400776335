"""smp2ds translator: SMP configuration dicts -> validated `SMPConfig` -> `Plan`.

Pure functions, no torch or deepspeed import, so ``smp2ds validate/convert/explain`` start fast.
Public API: ``load_document``, ``parse_json_text``, ``validate``, ``normalize``,
``resolve_layout``, ``plan`` and the types below.
"""

from __future__ import annotations

from .issues import InputError, Issue, SMPConfigError

# Imported eagerly on purpose: `validate` and `normalize` are also submodule names, and a lazy
# attribute would be shadowed by the submodule as soon as anything imported it.
from .load import load_document, parse_json_text  # noqa: E402
from .normalize import normalize  # noqa: E402
from .plan_types import KeyNote, Layout, Plan, SMPConfig
from .planner import plan  # noqa: E402
from .validate import validate  # noqa: E402
from .world_layout import ResolvedLayout, resolve_layout  # noqa: E402

__all__ = [
    "InputError",
    "Issue",
    "SMPConfigError",
    "KeyNote",
    "Layout",
    "Plan",
    "SMPConfig",
    "load_document",
    "parse_json_text",
    "validate",
    "normalize",
    "ResolvedLayout",
    "resolve_layout",
    "plan",
]
