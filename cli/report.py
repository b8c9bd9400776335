"""Rendering for the ``smp2ds`` command line: issues, plans, key-fate tables, estimates, launches.

Every function here is pure (value in, string out) so the subcommands stay thin and the output
format can be tested without running a command. Text is for people; JSON is one object per run,
built with `to_jsonable` so read-only mappings and dataclasses from the translator serialise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from smp2ds.translator.plan_types import Plan

FORMATS: tuple[str, ...] = ("text", "json")

_FATE_ORDER = ("mapped", "engine", "ignored", "unsupported")


def to_jsonable(value: Any) -> Any:
    """Turn translator results (MappingProxyType, tuples, dataclasses with ``to_dict``) into JSON types."""
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((to_jsonable(v) for v in value), key=repr)
    if hasattr(value, "to_dict") and callable(value.to_dict):
        return to_jsonable(value.to_dict())
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def dump_json(value: Any) -> str:
    """Pretty JSON (2-space indent, key order kept) ending in a newline."""
    return json.dumps(to_jsonable(value), indent=2, ensure_ascii=False) + "\n"


def compact(value: Any, width: int = 40) -> str:
    """One-line JSON rendering of a value, shortened to ``width`` characters for tables."""
    text = json.dumps(to_jsonable(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------------
# issues


def issue_to_dict(issue: Any) -> dict[str, Any]:
    """An `Issue` as JSON (pointer, message, given, allowed, hint; unset fields left out)."""
    return to_jsonable(issue.to_dict())


def render_issues_text(issues: Sequence[Any], source: str) -> str:
    """Every issue with its pointer, then given / allowed / hint on indented lines."""
    count = len(issues)
    lines = [f"{source}: invalid SMP configuration ({count} problem{'s' if count != 1 else ''})"]
    for issue in issues[:MAX_ISSUES_SHOWN]:
        lines.append(f"  {issue.pointer or '/'}: {issue.message}")
        if issue.has_given:
            lines.append(f"      given:   {compact(issue.given, 100)}")
        if issue.allowed is not None:
            lines.append(f"      allowed: {issue.allowed}")
        if issue.hint is not None:
            lines.append(f"      hint:    {issue.hint}")
    if count > MAX_ISSUES_SHOWN:
        lines.append(f"  ... and {count - MAX_ISSUES_SHOWN} more problems (not shown; fix these first)")
    return "\n".join(lines) + "\n"


MAX_ISSUES_SHOWN = 200
"""Problems printed in text form; the rest are counted (a hostile document cannot flood the terminal)."""


def render_issues_json(issues: Sequence[Any], source: str) -> str:
    """``{"source", "valid": false, "issues": [...]}`` as one JSON object."""
    return dump_json({"source": source, "valid": False, "issues": [issue_to_dict(i) for i in issues]})


# ---------------------------------------------------------------------------------------------
# tables


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], max_last: int | None = None) -> str:
    """A plain left-aligned text table; the last column is not padded (it may be long)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers) - 1)]
    out = []
    for n, row in enumerate(cells):
        last = row[-1] if max_last is None or len(row[-1]) <= max_last else row[-1][: max_last - 3] + "..."
        out.append("  ".join([c.ljust(w) for c, w in zip(row[:-1], widths)] + [last]).rstrip())
        if n == 0:
            out.append("  ".join(["-" * w for w in widths] + ["-" * max(len(headers[-1]), 6)]))
    return "\n".join(out) + "\n"


def fate_counts(notes: Sequence[Any]) -> dict[str, int]:
    """Number of keys per fate, in the order mapped, engine, ignored, unsupported."""
    counts = {fate: 0 for fate in _FATE_ORDER}
    for note in notes:
        counts[note.fate] = counts.get(note.fate, 0) + 1
    return counts


def render_fate_summary(notes: Sequence[Any]) -> str:
    """``12 mapped, 3 engine, 2 ignored, 1 unsupported`` (one line, no newline)."""
    return ", ".join(f"{n} {fate}" for fate, n in fate_counts(notes).items())


def render_key_table(notes: Sequence[Any]) -> str:
    """The key-fate table: key, value, fate, and the target pointer or the reason."""
    rows = []
    for note in notes:
        where = note.target or ""
        if note.reason:
            where = f"{where} ({note.reason})" if where else note.reason
        rows.append([note.key, compact(note.value, 32), note.fate, where])
    return table(["key", "value", "fate", "target / reason"], rows)


def render_mapping(title: str, mapping: Mapping[str, Any]) -> str:
    """``title`` then one ``key: value`` line per entry (values as compact JSON)."""
    lines = [f"{title}:"]
    if not mapping:
        lines.append("  (none)")
    width = max((len(str(k)) for k in mapping), default=0)
    for key, value in mapping.items():
        shown = value if isinstance(value, str) else compact(value, 100)
        lines.append(f"  {str(key).ljust(width)}  {shown}")
    return "\n".join(lines) + "\n"


def render_remarks(remarks: Sequence[str]) -> str:
    """Plan-level remarks as a bullet list ('' when there are none)."""
    if not remarks:
        return ""
    return "remarks:\n" + "".join(f"  - {r}\n" for r in remarks)


# ---------------------------------------------------------------------------------------------
# plans


def render_plan_text(plan: Plan) -> str:
    """Human-readable plan: topology, every section as JSON, then the key-fate table and remarks."""
    parts = [render_mapping("topology", plan.topology)]
    for name in ("deepspeed", "engine", "megatron"):
        parts.append(f"{name}:\n" + _indent(dump_json(getattr(plan, name))))
    parts.append("launcher:\n" + _indent(render_launcher_text(plan.launcher)))
    parts.append(f"keys ({render_fate_summary(plan.notes)}):\n" + _indent(render_key_table(plan.notes)))
    parts.append(render_remarks(plan.remarks))
    return "\n".join(p for p in parts if p)


def render_launcher_text(launcher: Mapping[str, Any]) -> str:
    """The launcher section for people: command lines shell-quoted, env as assignments."""
    import shlex

    lines: list[str] = []
    for key, value in launcher.items():
        if isinstance(value, Mapping) and key.lower() in ("env", "environment"):
            lines.append(f"{key}:")
            lines.extend(f"  {k}={shlex.quote(str(v))}" for k, v in value.items())
        elif isinstance(value, Mapping):
            lines.append(f"{key}:")
            for sub, cmd in value.items():
                lines.append(f"  {sub}: {_command_line(cmd)}")
        elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            lines.append(f"{key}: {_command_line(value)}")
        elif isinstance(value, str) and "\n" in value:
            lines.append(f"{key}:")
            lines.extend(f"  {line}" for line in value.splitlines())
        else:
            shown = value if isinstance(value, str) and value else compact(value, 200)
            lines.append(f"{key}: {shown}")
    return "\n".join(lines) + "\n"


def _command_line(cmd: Any) -> str:
    import shlex

    if isinstance(cmd, (list, tuple)) and all(isinstance(c, str) for c in cmd):
        return shlex.join(cmd)
    return cmd if isinstance(cmd, str) else compact(cmd, 200)


def _indent(text: str, prefix: str = "  ") -> str:
    return "".join(prefix + line if line.strip() else line for line in text.splitlines(keepends=True))


# ---------------------------------------------------------------------------------------------
# estimates


def human_bytes(n: float) -> str:
    """Bytes with a binary unit (``1.5 GiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} PiB"  # pragma: no cover - loop always returns


def human_count(n: float) -> str:
    """A parameter count as people write it (``30B``, ``1.3B``, ``350M``)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n:.0f}"


def render_estimate_text(estimate: Mapping[str, Any]) -> str:
    """Per-rank memory and traffic of each data-parallel scheme, then the chosen scheme's collectives."""
    schemes = estimate.get("schemes")
    if not isinstance(schemes, Mapping):  # an estimate of another shape: show it as it is
        return "estimate:\n" + "\n".join(_estimate_lines(estimate, "  ")) + "\n"
    selected = estimate.get("selected")
    head = (
        "per-rank model state and communication per optimizer step for "
        f"{human_count(estimate['n_params'])} parameters "
        f"({estimate['bytes_per_param_copy']}-byte parameter copies, "
        f"{estimate['gradient_accumulation_steps']} micro-batch(es) per step, "
        f"data-parallel size {estimate['data_parallel_size']}, {estimate['ranks_per_node']} ranks per node):"
    )
    rows = []
    for name, scheme in schemes.items():
        rows.append(
            [
                name + (" (this plan)" if name == selected else ""),
                human_bytes(scheme["memory_bytes_per_rank"]),
                f"{100 * scheme['memory_fraction']:.2f}%",
                human_bytes(scheme["bytes_per_rank"]),
                human_bytes(scheme["cross_node_bytes_per_rank"]),
            ]
        )
    parts = [head, table(["scheme", "memory/rank", "of unsharded", "traffic/rank", "cross-node/rank"], rows)]
    if selected in schemes:
        hops = [
            [
                h["name"],
                h["collective"],
                str(h["group_size"]),
                str(h["times_per_step"]),
                "yes" if h["spans_nodes"] else "no",
                human_bytes(h["bytes_per_rank"]),
            ]
            for h in schemes[selected]["hops"]
        ]
        parts.append(f"collectives of {selected}, per rank and optimizer step:")
        parts.append(table(["collective", "kind", "group", "times", "spans nodes", "bytes/rank"], hops))
    notes = estimate.get("assumptions") or []
    if notes:
        parts.append("assumptions:\n" + "".join(f"  - {n}\n" for n in notes))
    return "\n".join(p.rstrip("\n") for p in parts) + "\n"


def _estimate_lines(mapping: Mapping[str, Any], prefix: str) -> list[str]:
    lines: list[str] = []
    width = max((len(str(k)) for k in mapping), default=0)
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            lines.append(f"{prefix}{key}:")
            lines.extend(_estimate_lines(value, prefix + "  "))
            continue
        shown = value if isinstance(value, str) else compact(value, 100)
        if "bytes" in str(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
            shown = f"{human_bytes(value)}  ({value:,.0f})"
        lines.append(f"{prefix}{str(key).ljust(width)}  {shown}")
    return lines


# ---------------------------------------------------------------------------------------------
# launches


def render_launch_text(command: Sequence[str], env: Mapping[str, str], notices: Sequence[str]) -> str:
    """What ``smp2ds launch --dry-run`` prints: notices, the env it would set, the command."""
    import shlex

    lines = [f"# {n}" for n in notices]
    lines.extend(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    lines.append(shlex.join(command))
    return "\n".join(lines) + "\n"
