"""Read configuration documents: strict JSON (no duplicate keys, no NaN) with located errors.

The only module of the translator that touches files. ``parameters`` given as a path string
(the SageMaker SDK accepts a JSON file there) is read here, relative to the document naming it.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

from .document import pointer_of
from .issues import InputError, Issue, SMPConfigError


class _Pairs(dict):
    """A JSON object that remembers which keys were repeated (found again after parsing)."""

    duplicates: tuple[str, ...] = ()


class _Counter:
    """``object_pairs_hook`` for one parse: builds :class:`_Pairs` and counts keys (C speed when
    no key repeats, the common case)."""

    def __init__(self) -> None:
        self.keys = 0

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        self.keys += len(pairs)
        obj = _Pairs(pairs)
        if len(obj) != len(pairs):
            seen: list[str] = []
            counted: set[str] = set()
            for key, _ in pairs:
                if key in counted and key not in seen:
                    seen.append(key)
                counted.add(key)
            obj.duplicates = tuple(seen)
        return obj


MAX_KEYS = 10_000
"""Keys in one document (all levels). SMP configurations hold dozens; a document with millions
would make every later step slow, so it is refused right after parsing."""
MAX_DEPTH = 64
"""Nesting levels of objects and arrays. SMP documents nest about 5 deep."""


def _deepest(value: Any) -> tuple[int, tuple[Any, ...]]:
    """Depth of the deepest container and the path to the first container beyond :data:`MAX_DEPTH`
    (iterative: a hostile document must not exhaust the Python stack here)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    deepest = 0
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            children: Any = node.items()
        elif isinstance(node, list):
            children = enumerate(node)
        else:
            continue
        deepest = max(deepest, len(path) + 1)
        if len(path) + 1 > MAX_DEPTH:
            return deepest, path
        stack.extend((child, path + (key,)) for key, child in children)
    return deepest, ()


def _size_issues(value: Any, keys: int, source: str, prefix: tuple[Any, ...]) -> list[Issue]:
    if keys > MAX_KEYS:
        return [Issue(pointer_of(prefix), f"{source} has {keys} keys, more than any SMP configuration could use",
                      allowed=f"at most {MAX_KEYS} keys in one document")]
    depth, path = _deepest(value)
    if depth > MAX_DEPTH:
        return [Issue(pointer_of(prefix + path[:3]) + ("/..." if len(path) > 3 else ""),
                      f"{source} nests objects/arrays more than {MAX_DEPTH} levels deep",
                      allowed=f"at most {MAX_DEPTH} levels of nesting")]
    return []


def _reject_constant(name: str) -> Any:
    # NaN/Infinity are not JSON; Python's json accepts them unless told otherwise.
    raise ValueError(f"{name} is not valid JSON")


def _python_spelling_hint(text: str) -> str | None:
    """Configs are often pasted from Python notebooks; say so when it looks like that."""
    for word, fix in (("True", "true"), ("False", "false"), ("None", "null")):
        if f": {word}" in text or f":{word}" in text:
            return f"this looks like a Python dict: JSON spells `{word}` as `{fix}` and needs double quotes"
    if "'" in text and '"' not in text:
        return "JSON strings and keys need double quotes, not single quotes"
    return None


def _dup_issues(value: Any, path: tuple[Any, ...], source: str) -> list[Issue]:
    """Walk the parsed tree and report every repeated key at its own pointer."""
    issues: list[Issue] = []
    if isinstance(value, dict):
        for key in getattr(value, "duplicates", ()):
            issues.append(
                Issue(
                    pointer_of(path + (key,)),
                    f"duplicate key `{key}` in {source}: JSON keeps only the last value",
                    given=value[key],
                    hint=f"remove all but one `{key}`",
                )
            )
        for key, child in value.items():
            issues.extend(_dup_issues(child, path + (key,), source))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            issues.extend(_dup_issues(child, path + (index,), source))
    return issues


def _plain(value: Any) -> Any:
    """Replace the bookkeeping dict subclass with plain dicts."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def parse_json_text(text: str, source: str = "<input>", prefix: tuple[Any, ...] = ()) -> Any:
    """Parse JSON strictly; raise SMPConfigError on malformed JSON (with line/column) or duplicate keys.

    ``prefix`` is the path at which this text sits inside the user's document (used when a
    ``parameters`` file is loaded), so issue pointers stay pointers into the whole document.
    """
    counter = _Counter()
    try:
        value = json.loads(text, object_pairs_hook=counter, parse_constant=_reject_constant)
    except RecursionError:
        issue = Issue(pointer_of(prefix), f"{source} nests objects/arrays too deeply for the JSON reader",
                      allowed=f"at most {MAX_DEPTH} levels of nesting")
        raise SMPConfigError([issue]) from None
    except json.JSONDecodeError as err:
        raise SMPConfigError(
            [
                Issue(
                    pointer_of(prefix),
                    f"malformed JSON in {source} at line {err.lineno} column {err.colno}: {err.msg}",
                    hint=_python_spelling_hint(text),
                )
            ]
        ) from None
    except ValueError as err:
        raise SMPConfigError([Issue(pointer_of(prefix), f"invalid JSON in {source}: {err}")]) from None
    issues = _size_issues(value, counter.keys, source, prefix) or _dup_issues(value, prefix, source)
    if issues:
        raise SMPConfigError(issues)
    return _plain(value)


def read_text(path: str) -> str:
    """Read a file (or stdin for ``-``); unreadable input raises InputError."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read {path}: {err}") from None


def parameters_location(doc: Any) -> tuple[str, ...] | None:
    """Path of the modelparallel ``parameters`` inside an estimator spec or distribution dict."""
    if not isinstance(doc, dict):
        return None
    candidates = (("distribution", "smdistributed", "modelparallel"), ("smdistributed", "modelparallel"))
    for path in candidates:
        node: Any = doc
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict) and "parameters" in node:
            return path + ("parameters",)
    return None


def resolve_parameters_file(doc: Any, base_dir: str) -> Any:
    """Return ``doc`` with a string ``parameters`` replaced by the JSON file it names.

    Relative paths are resolved against ``base_dir`` (the directory of the document). A missing
    or malformed file raises SMPConfigError whose issue points at ``parameters``.
    """
    where = parameters_location(doc)
    if where is None:
        return doc
    node = doc
    for key in where[:-1]:
        node = node[key]
    ref = node["parameters"]
    if not isinstance(ref, str):
        return doc
    target = ref if os.path.isabs(ref) else os.path.join(base_dir, ref)
    try:
        with open(target, encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise SMPConfigError(
            [
                Issue(
                    pointer_of(where),
                    f"cannot read the parameters file {target}: {err.strerror or err}",
                    given=ref,
                    allowed="a JSON object, or the path of a JSON file holding one",
                    hint="paths are relative to the document that names them",
                )
            ]
        ) from None
    loaded = parse_json_text(text, source=target, prefix=where)
    out = copy.deepcopy(doc)
    holder = out
    for key in where[:-1]:
        holder = holder[key]
    holder["parameters"] = loaded
    return out


def load_document(path: str) -> Any:
    """Read and parse a configuration document; ``-`` reads stdin.

    Unreadable input raises InputError; malformed JSON, duplicate keys or an unreadable
    ``parameters`` file raise SMPConfigError. A string ``parameters`` is replaced by the JSON
    object of the file it names (relative to this document; to the working directory for stdin).
    """
    text = read_text(path)
    source = "<stdin>" if path == "-" else path
    doc = parse_json_text(text, source=source)
    base_dir = os.getcwd() if path == "-" else os.path.dirname(os.path.abspath(path))
    return resolve_parameters_file(doc, base_dir)
