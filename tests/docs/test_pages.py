"""The README and docs/ pages: each page's opening example runs, every link lands, the README stays short.

The opening examples run as a reader would type them: ``smp2ds`` commands in-process through the CLI's
``main`` (the same code as the console script), and the one command that trains (``smp2ds launch``, on
the checkpoints page) as a real 1-rank job under torchrun.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from smp2ds.cli import main as smp2ds
from tests.docs.pages import DOCS, OWN_PAGES, ROOT, anchors, links, opening_example, smp2ds_commands, transcripts

README = ROOT / "README.md"
CHECKPOINT_DIR = "/tmp/smp2ds-checkpoints"


def _commands(page: str):
    language, body = opening_example((DOCS / page).read_text())
    assert language == "bash", f"{page} opens with a {language or 'plain'} block"
    commands = smp2ds_commands(body)
    assert commands, f"{page}'s opening example has no smp2ds command"
    return commands


@pytest.mark.parametrize("page", OWN_PAGES)
def test_opening_example_runs(page, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    for command in _commands(page):
        if command.argv[0] == "launch" and "--dry-run" not in command.argv:
            continue  # trains: test_the_one_training_example_runs
        code = smp2ds(command.argv)
        out = capsys.readouterr()
        assert code == command.exit_code, f"smp2ds {' '.join(command.argv)} -> {code}\n{out.out}\n{out.err}"
        assert out.out.strip(), f"smp2ds {' '.join(command.argv)} printed nothing"


@pytest.mark.parametrize("page", ["performance.md"])
def test_printed_outputs_are_what_the_command_prints(page, monkeypatch, capsys):
    shown = transcripts((DOCS / page).read_text())
    assert shown, f"{page} shows no `$ smp2ds` output"
    monkeypatch.chdir(ROOT)
    for argv, output in shown:
        assert smp2ds(argv) == 0
        assert capsys.readouterr().out == output, f"smp2ds {' '.join(argv)} prints something else now"


@pytest.mark.slow
def test_the_one_training_example_runs(tmp_path):
    launches = [c for p in OWN_PAGES for c in _commands(p) if c.argv[0] == "launch" and "--dry-run" not in c.argv]
    assert len(launches) == 1, "keep one training example in the docs: it is the slow part of this file"
    out = tmp_path / "checkpoints"
    argv = [str(out) if word == CHECKPOINT_DIR else word for word in launches[0].argv]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "smp2ds.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 1 loss" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["newest", "step2_partial"]  # what the page says ls shows


def _pages():
    return [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("path", _pages(), ids=lambda p: p.name)
def test_links_land(path):
    text = path.read_text()
    for target in links(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        assert dest.exists(), f"{path.name}: link to {target} ({rel}) has no file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest.read_text()), f"{path.name}: {target} has no heading #{anchor}"


def test_readme_is_short_and_keeps_the_set_up():
    text = README.read_text()
    assert len(text.encode()) <= 8192, f"README is {len(text.encode())} bytes"
    assert "bash .ci/demo" in text and "bash .ci/test" in text
    assert "CI (`.ci/run`)\nruns `bash .ci/test`" in text or "CI (`.ci/run`) runs `bash .ci/test`" in text
    for launcher in ("smp2ds launch", "deepspeed --num_gpus", "torchrun --nproc-per-node", "mpirun -np"):
        assert launcher in text


def test_readme_links_every_page():
    text = README.read_text()
    for page in OWN_PAGES:
        assert f"docs/{page}" in text, f"README does not link docs/{page}"
