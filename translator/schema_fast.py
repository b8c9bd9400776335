"""A fast yes/no schema check for the common case, so valid documents never import jsonschema.

Importing jsonschema (with referencing, attrs, rpds and its format checkers) costs more than
everything else ``smp2ds convert`` does. Most documents are valid, and for a valid document the
only answer needed is "no issues". ``is_valid`` walks our four schemas directly for the keywords
they use, with SMP's exact types (``True`` is not an integer, ``1`` is not a float), and answers:

* True: the document is valid; jsonschema would report nothing;
* False: something is wrong (or a rule may be broken): ask jsonschema for the full story;
* None: the schema uses a keyword this walker does not know: ask jsonschema.

So a wrong answer can only cost time, never an issue, provided True is never given for an
invalid document. ``tests/translator/test_schema_fast.py`` checks that against jsonschema on
every example and on many broken variants of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import cache
from typing import Any

from smp2ds.schemas import load_schema

# Keywords that only describe (no effect on validity).
_ANNOTATIONS = frozenset(
    {"$schema", "$id", "$comment", "title", "description", "default", "examples", "deprecated", "readOnly"}
)


class _Unknown(Exception):
    """The schema uses a keyword this walker does not evaluate."""


def is_valid(instance: Any, schema_name: str) -> bool | None:
    """True when ``instance`` is valid against schema ``schema_name``; False or None: ask jsonschema."""
    try:
        return _check(instance, load_schema(schema_name))
    except _Unknown:
        return None


@cache
def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(text)


def _is_type(value: Any, wanted: str) -> bool:
    if wanted == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if wanted == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if wanted == "boolean":
        return isinstance(value, bool)
    if wanted == "string":
        return isinstance(value, str)
    if wanted == "object":
        return isinstance(value, dict)
    if wanted == "array":
        return isinstance(value, list)
    if wanted == "null":
        return value is None
    raise _Unknown(wanted)


def _equal(one: Any, two: Any) -> bool:
    """JSON equality as jsonschema's enum/const use it: ``true`` is not ``1``."""
    if isinstance(one, bool) or isinstance(two, bool):
        return type(one) is type(two) and one == two
    if isinstance(one, dict) and isinstance(two, dict):
        return one.keys() == two.keys() and all(_equal(one[k], two[k]) for k in one)
    if isinstance(one, list) and isinstance(two, list):
        return len(one) == len(two) and all(_equal(a, b) for a, b in zip(one, two))
    return one == two


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(value: Any, schema: Any) -> bool:  # noqa: C901 - one branch per keyword reads best
    if schema is True:
        return True
    if schema is False:
        return False
    if not isinstance(schema, Mapping):
        raise _Unknown(repr(schema))
    for key, rule in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key == "type":
            if not any(_is_type(value, t) for t in ([rule] if isinstance(rule, str) else rule)):
                return False
        elif key == "x-smp-exact-type":
            if rule != "float":
                raise _Unknown(f"x-smp-exact-type {rule}")
            if isinstance(value, int) and not isinstance(value, bool):
                return False
        elif key.startswith("x-smp-"):
            continue  # our annotations; x-smp-rule subschemas are evaluated like any other
        elif key == "enum":
            if not any(_equal(value, option) for option in rule):
                return False
        elif key == "const":
            if not _equal(value, rule):
                return False
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if _number(value) and not _in_bound(key, value, rule):
                return False
        elif key == "pattern":
            if isinstance(value, str) and not _pattern(rule).search(value):
                return False
        elif key == "$ref":
            if "#" in rule:
                raise _Unknown(rule)
            if not _check(value, load_schema(rule)):
                return False
        elif key in ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "items"):
            if not _applicators(key, value, rule, schema):
                return False
        elif key in (
            "properties",
            "patternProperties",
            "additionalProperties",
            "required",
            "minProperties",
            "maxProperties",
            "dependentRequired",
        ):
            if isinstance(value, dict) and not _object_rule(key, value, rule, schema):
                return False
        else:
            raise _Unknown(key)
    return True


def _in_bound(key: str, value: float, bound: float) -> bool:
    if key == "minimum":
        return value >= bound
    if key == "maximum":
        return value <= bound
    if key == "exclusiveMinimum":
        return value > bound
    return value < bound


def _applicators(key: str, value: Any, rule: Any, schema: Mapping[str, Any]) -> bool:
    if key == "allOf":
        return all(_check(value, sub) for sub in rule)
    if key == "anyOf":
        return any(_check(value, sub) for sub in rule)
    if key == "oneOf":
        return sum(1 for sub in rule if _check(value, sub)) == 1
    if key == "not":
        return not _check(value, rule)
    if key == "if":
        branch = "then" if _check(value, rule) else "else"
        return _check(value, schema.get(branch, True))
    if key in ("then", "else"):
        return True  # evaluated with their `if`
    if key == "items":
        return not isinstance(value, list) or all(_check(item, rule) for item in value)
    raise _Unknown(key)


def _object_rule(key: str, value: dict[str, Any], rule: Any, schema: Mapping[str, Any]) -> bool:
    if key == "properties":
        return all(_check(value[name], sub) for name, sub in rule.items() if name in value)
    if key == "patternProperties":
        return all(
            _check(item, sub)
            for pattern, sub in rule.items()
            for name, item in value.items()
            if _pattern(pattern).search(name)
        )
    if key == "additionalProperties":
        known = schema.get("properties", {})
        patterns = [_pattern(p) for p in schema.get("patternProperties", {})]
        return all(
            _check(item, rule)
            for name, item in value.items()
            if name not in known and not any(p.search(name) for p in patterns)
        )
    if key == "required":
        return all(name in value for name in rule)
    if key == "minProperties":
        return len(value) >= rule
    if key == "maxProperties":
        return len(value) <= rule
    if key == "dependentRequired":
        return all(all(n in value for n in needed) for name, needed in rule.items() if name in value)
    raise _Unknown(key)
