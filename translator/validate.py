"""``validate(doc, layout)``: every problem of an SMP configuration at once, [] when it is valid.

Schema problems (schema_check.py), cross-key rules (semantics.py) and world-size arithmetic
(world_layout.py) are collected by normalize.py's ``analyse``, the pass ``normalize`` shares; this
module only drops the config it builds.
"""

from __future__ import annotations

from typing import Any

from .issues import Issue
from .normalize import analyse
from .plan_types import Layout


def validate(doc: Any, layout: Layout | None = None) -> list[Issue]:
    """All problems of ``doc`` at once (schema, cross-key rules, world layout); [] when valid.

    ``doc`` is a bare SMP v1 parameters dict, a ``distribution`` dict, an estimator spec or an
    SMP v2 dict; a string ``parameters`` is read relative to the working directory (use
    ``load_document`` to resolve it relative to a file).
    """
    issues, _config = analyse(doc, layout)
    return issues
