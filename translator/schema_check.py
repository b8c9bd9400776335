"""Schema validation with SMP's exact types, rendered as Issues that point into the user's document.

``schema_issues`` is the schema half of validation, used by normalize.py's ``analyse``; the
cross-key rules are semantics.py's and the world-size arithmetic world_layout.py's. The public entry
point that runs all three is ``validate`` (validate.py).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Any

from smp2ds.schemas import SCHEMA_FILES, load_schema

from .document import V2_ONLY_KEYS, Document, pointer_of
from .issues import Issue
from .schema_fast import is_valid
from .suggest import close_matches, unknown_key_hint

if TYPE_CHECKING:  # jsonschema is imported only when a document needs its detailed errors
    from jsonschema.exceptions import ValidationError
    from referencing import Registry

SCHEMA_FOR_KIND = {
    "parameters": "smp_v1",
    "smp_v2": "smp_v2",
    "distribution": "distribution",
    "estimator": "estimator",
}
_TYPE_NAMES = {
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean (true or false)",
    "string": "a string",
    "object": "a JSON object",
    "array": "a list",
    "null": "null",
}
_LONG_LIST = 12  # longer allowed-key lists are summarised instead of printed
MAX_UNKNOWN_LISTED = 50  # unknown keys of one object reported one by one; the rest are counted


def _is_int(_checker: Any, value: Any) -> bool:
    # SMP checks `type(v) in allowed`: True is not an int and 4.0 / 5e8 are floats.
    return isinstance(value, int) and not isinstance(value, bool)


def _exact_type(_validator: Any, wanted: str, instance: Any, _schema: Any) -> Iterator[ValidationError]:
    # SMP's float keys reject ints (`1` is not a float there). Kept out of the type checker
    # because jsonschema's `minimum`/`maximum` only look at instances of type "number".
    from jsonschema.exceptions import ValidationError

    if wanted == "float" and isinstance(instance, int) and not isinstance(instance, bool):
        yield ValidationError(f"{instance!r} is not a float")


@cache
def strict_validator_class() -> Any:
    """Draft 2020-12 with SMP's exact types: ``integer`` excludes booleans and 4.0, plus x-smp-exact-type."""
    from jsonschema import Draft202012Validator, validators

    checker = Draft202012Validator.TYPE_CHECKER.redefine("integer", _is_int)
    return validators.extend(
        Draft202012Validator, validators={"x-smp-exact-type": _exact_type}, type_checker=checker
    )


def _without_dialect(name: str) -> dict[str, Any]:
    # jsonschema picks the validator class of a referenced schema from its `$schema`, which
    # would silently swap our strict type checker for the stock one behind every `$ref`.
    # Without `$schema` the referencing validator's own class is kept.
    return {k: v for k, v in load_schema(name).items() if k != "$schema"}


@lru_cache(maxsize=1)
def registry() -> Registry:
    """Our four schemas by ``$id`` (draft 2020-12), so cross-file ``$ref`` resolves offline."""
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012

    resources = []
    for name in SCHEMA_FILES:
        schema = _without_dialect(name)
        resources.append((schema["$id"], DRAFT202012.create_resource(schema)))
    return Registry().with_resources(resources)


@cache
def validator_for(name: str) -> Any:
    """A strict-typed draft 2020-12 validator for schema ``name``."""
    return strict_validator_class()(_without_dialect(name), registry=registry())


def type_name(value: Any) -> str:
    """JSON type of a Python value, as the user would call it."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def spell_float(value: float) -> str:
    """How the user most likely wrote a large whole float: 500000000.0 -> ``5e8``."""
    if value and math.isfinite(value) and value.is_integer() and abs(value) >= 1e5:
        exponent = math.floor(math.log10(abs(value)))
        mantissa = round(value / 10**exponent, 9)
        text = f"{mantissa:g}"
        return f"{text}e{exponent}"
    return repr(value)


def type_hint(value: Any, expected: Iterable[str]) -> str | None:
    """A concrete rewrite of ``value`` into the expected JSON type, when one is obvious."""
    expected = set(expected)
    text = value.strip() if isinstance(value, str) else None
    if "integer" in expected:
        if isinstance(value, float) and value.is_integer():
            return f"write {int(value)} (an int), not {spell_float(value)}"
        if isinstance(value, bool):
            return "SMP does not accept true/false as an integer; write a number"
        if text is not None and re.fullmatch(r"[+-]?\d+", text):
            return f"write {int(text)} without quotes"
        if (
            text is not None
            and re.fullmatch(r"[+-]?\d+(\.\d*)?[eE]\+?\d+", text)
            and float(text).is_integer()
        ):
            return f"write {int(float(text))} (an int) without quotes"
        if isinstance(value, float):
            return "SMP needs a whole number here"
    if "number" in expected:
        if isinstance(value, int) and not isinstance(value, bool):
            return f"write {value}.0 (SMP requires a float here, not an int)"
        if text is not None and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text):
            return f"write {float(text)!r} without quotes"
    if "boolean" in expected:
        if text is not None and text.lower() in ("true", "false"):
            return f"write {text.lower()} (a JSON boolean) without quotes"
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return f"write {'true' if value else 'false'} (a JSON boolean), not {value}"
    return None


def _expected_types(schema: Any) -> list[str]:
    types = schema.get("type", []) if isinstance(schema, dict) else []
    return [types] if isinstance(types, str) else list(types)


def _type_issue(err: ValidationError, pointer: str) -> Issue:
    expected = _expected_types(err.schema)
    wanted = " or ".join(_TYPE_NAMES.get(t, t) for t in expected)
    if err.schema.get("x-smp-exact-type") == "float":
        wanted = "a float"
    return Issue(
        pointer,
        f"must be {wanted}, not {_article(type_name(err.instance))}",
        given=err.instance,
        allowed=wanted,
        hint=type_hint(err.instance, expected),
    )


def _article(name: str) -> str:
    return ("an " if name[0] in "aeiou" else "a ") + name if name != "null" else "null"


def _enum_issue(err: ValidationError, pointer: str) -> Issue:
    options = list(err.validator_value)
    allowed = ", ".join(json.dumps(o) for o in options)
    hint = None
    if isinstance(err.instance, str):
        near = close_matches(err.instance, [o for o in options if isinstance(o, str)], n=1)
        if near:
            hint = f'did you mean "{near[0]}"?'
    return Issue(pointer, f"must be one of {allowed}", given=err.instance, allowed=allowed, hint=hint)


def _bound_issue(err: ValidationError, pointer: str) -> Issue:
    schema = err.schema
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and high is not None:
        allowed = f"{low} <= value <= {high}"
    elif low is not None:
        allowed = f">= {low}"
    else:
        allowed = f"<= {high}"
    return Issue(pointer, f"must be {allowed}", given=err.instance, allowed=allowed)


def _unknown_key_issues(err: ValidationError, path: tuple[Any, ...], doc: Document) -> list[Issue]:
    allowed = list(err.schema.get("properties", {}))
    patterns = [re.compile(p) for p in err.schema.get("patternProperties", {})]
    known = set(allowed)
    extras = [k for k in err.instance if k not in known and not any(p.search(k) for p in patterns)]
    here = doc.base + path
    in_params = path == doc.params_path and doc.strategy == "modelparallel"
    what = (
        "SMP v2 parameter" if in_params and doc.smp_version == 2 else "SMP parameter" if in_params else "key"
    )
    source = str(err.schema.get("$id", "")).rsplit("/", 1)[-1] or "the schema"
    shown = (
        ", ".join(allowed) if len(allowed) <= _LONG_LIST else f"one of the {len(allowed)} keys of {source}"
    )
    issues = []
    if len(extras) > MAX_UNKNOWN_LISTED:
        # a hostile or generated document: list a few (hints cost ~1 ms each), count the rest
        rest = len(extras) - MAX_UNKNOWN_LISTED
        issues.append(Issue(pointer_of(path), f"{len(extras)} unknown {what}s; the first {MAX_UNKNOWN_LISTED} are "
                            f"listed, {rest} more are not", allowed=shown))
        extras = extras[:MAX_UNKNOWN_LISTED]
    for key in extras:
        hint = unknown_key_hint(key, allowed, here, doc.kind)
        hint = _version_hint(key, doc, in_params) or hint
        issues.append(
            Issue(
                pointer_of(path + (key,)),
                f"unknown {what} `{key}`",
                given=err.instance[key],
                allowed=shown,
                hint=hint,
            )
        )
    return issues


def _version_hint(key: str, doc: Document, in_params: bool) -> str | None:
    """A key of the other SMP major version: say which version it belongs to."""
    if not in_params:
        return None
    if doc.smp_version == 1 and key in load_schema("smp_v2")["properties"]:
        return (
            f"`{key}` is an SMP v2 key; SMP v2 runs with `torch_distributed: {{enabled: true}}` "
            "in the distribution instead of `mpi`"
        )
    if doc.smp_version == 2 and key in load_schema("smp_v1")["properties"]:
        if doc.kind == "smp_v2":
            markers = ", ".join(f"`{k}`" for k in sorted(V2_ONLY_KEYS & set(doc.params)))
            return f"`{key}` is an SMP v1 key; this dict is read as SMP v2 because it has {markers}"
        return f"`{key}` is an SMP v1 key; SMP v2 (torch_distributed) does not accept it"
    return None


def _required_issues(err: ValidationError, path: tuple[Any, ...]) -> list[Issue]:
    missing = [k for k in err.validator_value if k not in err.instance]
    return [Issue(pointer_of(path + (k,)), f"missing required key `{k}`", hint=f"add `{k}`") for k in missing]


def _count_issue(err: ValidationError, pointer: str, path: tuple[Any, ...]) -> Issue:
    names = ", ".join(f"`{k}`" for k in err.schema.get("properties", {}))
    if err.validator == "maxProperties" and path[-1:] == ("smdistributed",):
        return Issue(
            pointer,
            "`modelparallel` and `dataparallel` cannot both be in `smdistributed`",
            given=sorted(err.instance),
            allowed=f"exactly one of {names}",
            hint="SMP does data parallelism itself (`ddp: true`); keep `modelparallel`",
        )
    return Issue(
        pointer, f"must contain exactly one of {names}", given=err.instance, allowed=f"one of {names}"
    )


def _pattern_issue(err: ValidationError, pointer: str) -> Issue:
    hint = None
    if isinstance(err.instance, str) and re.fullmatch(r"[a-z0-9-]+\.[a-z0-9-]+", err.instance):
        hint = f"write ml.{err.instance}"
    return Issue(pointer, "must be an instance type like ml.p4d.24xlarge", given=err.instance, hint=hint)


def render(err: ValidationError, doc: Document, prefix: tuple[Any, ...] = ()) -> list[Issue]:
    """Turn one jsonschema error into Issues (several for several unknown/missing keys)."""
    if isinstance(err.schema, dict) and "x-smp-rule" in err.schema:
        return []  # cross-key rules are reported by semantics.py, with values and hints
    path = prefix + tuple(err.absolute_path)
    pointer = pointer_of(path)
    kind = err.validator
    if kind == "additionalProperties":
        return _unknown_key_issues(err, path, doc)
    if kind == "required":
        return _required_issues(err, path)
    if kind == "type":
        return [_type_issue(err, pointer)]
    if kind == "x-smp-exact-type":
        return [
            Issue(
                pointer,
                "must be a float, not an integer",
                given=err.instance,
                allowed="a float",
                hint=type_hint(err.instance, ["number"]),
            )
        ]
    if kind == "enum":
        return [_enum_issue(err, pointer)]
    if kind == "const":
        return [Issue(pointer, f"must be {json.dumps(err.validator_value)}", given=err.instance)]
    if kind in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return [_bound_issue(err, pointer)]
    if kind in ("minProperties", "maxProperties"):
        return [_count_issue(err, pointer, path)]
    if kind == "pattern":
        return [_pattern_issue(err, pointer)]
    return [Issue(pointer, err.message, given=err.instance)]


def schema_issues(
    instance: Any, schema_name: str, doc: Document, prefix: tuple[Any, ...] = ()
) -> list[Issue]:
    """Every schema problem of ``instance`` (which sits at ``prefix`` inside the user's document)."""
    if is_valid(instance, schema_name):  # the common case, answered without importing jsonschema
        return []
    found: list[tuple[str, Issue]] = []
    for err in validator_for(schema_name).iter_errors(instance):
        found.extend((str(err.validator), issue) for issue in render(err, doc, prefix))
    # One message per value: an enum error already lists what is allowed, so it replaces the
    # type error; a type error makes range errors on the same value moot.
    kinds: dict[str, set[str]] = {}
    for kind, issue in found:
        kinds.setdefault(issue.pointer, set()).add(kind)
    keep = []
    for kind, issue in found:
        here = kinds[issue.pointer]
        if kind == "type" and "enum" in here:
            continue
        if (
            kind in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern")
            and "type" in here
        ):
            continue
        keep.append(issue)
    return keep
