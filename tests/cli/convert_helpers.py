"""What the ``smp2ds convert`` tests share: running the command in-process, and stand-in programs on ``PATH``."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from smp2ds.cli import main


def convert(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``smp2ds convert ARGV``'s standard output; the command must succeed."""
    code = main(["convert", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def write_stub(folder: Path, name: str, body: str, shebang: str = "/bin/sh") -> None:
    """An executable ``folder/name`` running ``body`` under ``shebang`` (a stand-in for srun, torchrun, ...)."""
    path = folder / name
    path.write_text(f"#!{shebang}\n{body}", encoding="utf-8")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
