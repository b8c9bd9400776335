"""``smp2ds checkpoint``'s command line: registered, documented, and torch-free until it runs.

What the actions do with real checkpoints is tested in ``tests/engine/checkpoint_tools/``.
"""

from __future__ import annotations

import subprocess
import sys

from smp2ds.cli import main


def test_help_lists_the_actions_and_flags(capsys):
    assert main(["--help"]) == 0
    assert "checkpoint" in capsys.readouterr().out
    assert main(["checkpoint", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(action in out for action in ("inspect", "consolidate", "export"))
    assert main(["checkpoint", "export", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--config" in out and "--model-type" in out and "--num-attention-heads" in out


def test_usage_errors_exit_2():
    assert main(["checkpoint"]) == 2  # an action is required
    assert main(["checkpoint", "consolidate", "somewhere"]) == 2  # --out is required
    # --config and --model-type both (neither is allowed: the user content's model_config is then used)
    assert main(["checkpoint", "export", "somewhere", "--to", "hf", "d", "--config", "c.json",
                 "--model-type", "gpt2"]) == 2
    assert main(["checkpoint", "inspect", "x", "--format", "yaml"]) == 2


def test_parsing_and_help_never_import_torch():
    probe = (
        "import sys\n"
        "from smp2ds.cli import main\n"
        "assert main(['checkpoint', 'inspect', '--help']) == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers'))\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_missing_folder_is_exit_1_with_its_name(tmp_path, capsys):
    assert main(["checkpoint", "inspect", str(tmp_path / "gone")]) == 1
    out = capsys.readouterr().out
    assert "UNREADABLE" in out and "gone: no such file or folder" in out
