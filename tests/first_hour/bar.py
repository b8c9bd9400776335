"""The bar every first-hour error message is held to (shared by the fast and the multi-rank tests)."""

from __future__ import annotations

MAX_LINES = 3


def assert_names_cause_and_fix(message: str, cause: list[str], fix: list[str]) -> None:
    """``message`` fits in three lines and contains every ``cause`` and every ``fix`` fragment."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    assert 0 < len(lines) <= MAX_LINES, f"{len(lines)} lines:\n{message}"
    for part in [*cause, *fix]:
        assert part in message, f"{part!r} missing from:\n{message}"
