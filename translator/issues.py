"""Configuration problems: one `Issue` per problem, raised together as `SMPConfigError`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

_UNSET: Any = object()


def _show(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


@dataclass(frozen=True)
class Issue:
    """One problem in a configuration document.

    `pointer` is an RFC 6901 JSON pointer into the document the user gave ("" is the root),
    `given` the offending value (left unset when the problem is a missing key), `allowed` a
    short statement of what is accepted and `hint` a concrete fix where one exists.
    """

    pointer: str
    message: str
    given: Any = _UNSET
    allowed: str | None = None
    hint: str | None = None

    @property
    def has_given(self) -> bool:
        return self.given is not _UNSET

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pointer": self.pointer, "message": self.message}
        if self.has_given:
            out["given"] = self.given
        if self.allowed is not None:
            out["allowed"] = self.allowed
        if self.hint is not None:
            out["hint"] = self.hint
        return out

    def __str__(self) -> str:
        text = f"{self.pointer or '/'}: {self.message}"
        if self.has_given:
            text += f" (given: {_show(self.given)})"
        if self.allowed is not None:
            text += f"; allowed: {self.allowed}"
        if self.hint is not None:
            text += f"; hint: {self.hint}"
        return text


class SMPConfigError(ValueError):
    """An invalid SMP configuration: carries every problem found, sorted by pointer."""

    def __init__(self, issues: Iterable[Issue]):
        unique = {(i.pointer, i.message): i for i in issues}
        self.issues: tuple[Issue, ...] = tuple(sorted(unique.values(), key=lambda i: (i.pointer, i.message)))
        super().__init__(str(self))

    def __str__(self) -> str:
        count = len(self.issues)
        head = f"invalid SMP configuration ({count} problem{'s' if count != 1 else ''}):"
        return "\n".join([head] + [f"  {issue}" for issue in self.issues])


class InputError(OSError):
    """The input could not be read at all (missing file, unreadable stream): a usage/I-O error."""
