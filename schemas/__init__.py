"""JSON Schemas (draft 2020-12) for SMP configurations, shipped as files inside the package.

Each schema's ``$id`` is ``https://smp2ds.dev/schemas/<file>`` and cross-file ``$ref`` values are
relative file names, so the schemas resolve among themselves both by ``$id`` (``retrieve``, for
JSON Schema libraries) and as files next to each other (``schema_path``, for editors: VS Code's
``json.schemas`` setting can point at the installed files; ``smp2ds schema --vscode`` prints it).
The files are read with plain ``open`` next to this module: cheaper at start-up than
``importlib.resources`` and the same files editors are given.
"""

from __future__ import annotations

import json
import os
from functools import cache
from typing import Any

SCHEMA_FILES: dict[str, str] = {
    "smp_v1": "smp_v1.schema.json",
    "distribution": "distribution.schema.json",
    "estimator": "estimator.schema.json",
    "smp_v2": "smp_v2.schema.json",
}
ID_BASE = "https://smp2ds.dev/schemas/"
"""Prefix of every schema's ``$id``; the rest is the file name."""
FOLDER = os.path.dirname(os.path.abspath(__file__))


def schema_name(name_or_id: str) -> str:
    """The schema name (key of SCHEMA_FILES) for a name, a file name or an ``$id`` URL.

    ``estimator``, ``estimator.schema.json`` and ``https://smp2ds.dev/schemas/estimator.schema.json``
    all give ``estimator``; anything else is a KeyError naming what is allowed.
    """
    text = name_or_id.split("#", 1)[0]
    if text in SCHEMA_FILES:
        return text
    file_name = text[len(ID_BASE) :] if text.startswith(ID_BASE) else text
    for name, known in SCHEMA_FILES.items():
        if file_name == known:
            return name
    allowed = ", ".join(SCHEMA_FILES)
    raise KeyError(
        f"unknown schema {name_or_id!r}; expected one of {allowed}, a file name like "
        f"estimator.schema.json or an $id like {ID_BASE}estimator.schema.json"
    )


def schema_path(name_or_id: str) -> str:
    """Absolute path of the installed schema file (what an editor setting points at)."""
    return os.path.join(FOLDER, SCHEMA_FILES[schema_name(name_or_id)])


def schema_id(name_or_id: str) -> str:
    """The ``$id`` URL of a schema."""
    return ID_BASE + SCHEMA_FILES[schema_name(name_or_id)]


@cache
def _load(name: str) -> dict[str, Any]:
    with open(os.path.join(FOLDER, SCHEMA_FILES[name]), encoding="utf-8") as handle:
        return json.load(handle)


def load_schema(name_or_id: str) -> dict[str, Any]:
    """The parsed schema for a name (key of SCHEMA_FILES), file name or ``$id`` URL (cached: do not modify)."""
    return _load(schema_name(name_or_id))


def retrieve(uri: str) -> Any:
    """A ``referencing`` retrieve hook: the installed schema behind an ``$id`` URL, offline.

    ``Registry(retrieve=retrieve)`` resolves every ``$ref`` between the four schemas (relative
    refs are joined to the referring schema's ``$id`` first) without network access.
    """
    from referencing.jsonschema import DRAFT202012

    try:
        return DRAFT202012.create_resource(load_schema(uri))
    except KeyError as err:
        from referencing.exceptions import NoSuchResource

        raise NoSuchResource(ref=uri) from err
