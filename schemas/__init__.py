"""JSON Schemas (draft 2020-12) for SMP configurations, loaded with importlib.resources."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

SCHEMA_FILES: dict[str, str] = {
    "smp_v1": "smp_v1.schema.json",
    "distribution": "distribution.schema.json",
    "estimator": "estimator.schema.json",
    "smp_v2": "smp_v2.schema.json",
}


@cache
def load_schema(name: str) -> dict[str, Any]:
    """Return the parsed schema ``name`` (a key of SCHEMA_FILES)."""
    if name not in SCHEMA_FILES:
        raise KeyError(f"unknown schema {name!r}; expected one of {sorted(SCHEMA_FILES)}")
    text = resources.files(__name__).joinpath(SCHEMA_FILES[name]).read_text(encoding="utf-8")
    return json.loads(text)
