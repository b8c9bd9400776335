"""Reading the documentation pages: their opening example, their links and their headings' anchors."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

OWN_PAGES = (
    "migrating-from-sagemaker.md",
    "data-parallel.md",
    "sharded-data-parallel.md",
    "pipelines.md",
    "tensor-parallel.md",
    "checkpoints.md",
    "hf-trainer.md",
    "configuration.md",
    "troubleshooting.md",
    "cli.md",
    "performance.md",
    "architecture.md",
    "memory.md",
    "leaving-smp.md",
)
"""Pages whose opening example tests/docs/test_pages.py runs (doctor, diagrams and smp-semantics test their own)."""

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_EXIT = re.compile(r"#\s*exit (\d+)")


@dataclass(frozen=True)
class Command:
    """One ``smp2ds`` line of an opening example and the exit code its comment promises (0 by default)."""

    argv: list[str]
    exit_code: int


def opening_example(text: str) -> tuple[str, str]:
    """(language, body) of the page's first fenced block; it must come before the first ``##`` section."""
    match = _FENCE.search(text)
    assert match, "the page has no code block"
    first_section = text.find("\n## ")
    assert first_section == -1 or match.start() < first_section, "the first code block is not at the top"
    return match.group(1), match.group(2)


def smp2ds_commands(body: str) -> list[Command]:
    """The ``smp2ds ...`` lines of a bash block (other lines, like ``ls``, are for the reader)."""
    commands = []
    for line in body.splitlines():
        code, _, comment = line.partition(" #")
        words = shlex.split(code)
        if words[:1] == ["smp2ds"]:
            expected = _EXIT.search("#" + comment)
            commands.append(Command(words[1:], int(expected.group(1)) if expected else 0))
    return commands


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Anchors of every heading outside code blocks."""
    prose = _FENCE.sub("", text)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", prose, re.M)}


def links(text: str) -> list[str]:
    """Every Markdown link target outside code blocks."""
    return _LINK.findall(_FENCE.sub("", text))


def transcripts(text: str) -> list[tuple[list[str], str]]:
    """``$ smp2ds ...`` lines inside code blocks and the output printed under each (to the next ``$`` line)."""
    found = []
    for match in _FENCE.finditer(text):
        command, output = None, []
        for line in [*match.group(2).splitlines(), "$ end"]:
            if line.startswith("$ "):
                if command is not None:
                    found.append((command, "\n".join(output).strip("\n") + "\n"))
                words = shlex.split(line[2:])
                command, output = (words[1:], []) if words[:1] == ["smp2ds"] else (None, [])
            elif command is not None:
                output.append(line)
    return found
