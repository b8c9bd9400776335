"""The likely first-hour mistakes a user meets before a model exists, checked end to end.

Each is made as a user makes it: a real one-process SMP script (``python train.py``, the environment
variables a launcher would set) or the ``smp2ds`` command. The message must name the cause and the fix
in at most three lines, and configuration mistakes must not print a traceback. The mistakes that need a
model or several ranks are in ``test_mistakes_dist.py``; ``docs/troubleshooting.md`` lists all ten.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smp2ds.cli import main as smp2ds
from smp2ds.engine.core.version_check import release, require_deepspeed
from smp2ds.engine.exceptions import SMPUnsupportedError
from tests.first_hour.bar import assert_names_cause_and_fix

ROOT = Path(__file__).resolve().parents[2]
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

INIT_ONLY = "import smdistributed.modelparallel.torch as smp\nsmp.init()\nprint('started')\n"
MODEL_FIRST = (
    "import torch\nimport smdistributed.modelparallel.torch as smp\n"
    "model = smp.DistributedModel(torch.nn.Linear(4, 4))\nsmp.init()\n"
)


def _script(tmp_path: Path, body: str, env: dict[str, str], pythonpath: str | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(body)
    full = {k: v for k, v in os.environ.items() if k not in ("SM_HP_MP_PARAMETERS", "RANK", "WORLD_SIZE")}
    full.update(ENV, **env)
    if pythonpath:
        full["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, full.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=full, capture_output=True, text=True,
                          timeout=240)


def _config_failure(done: subprocess.CompletedProcess) -> str:
    """What a configuration mistake printed: non-zero exit, no traceback, smp2ds's message."""
    assert done.returncode != 0, done.stdout
    assert "started" not in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    start = done.stderr.index("smp2ds:")
    return done.stderr[start:]


def test_world_size_that_does_not_fit_the_degrees(tmp_path):
    done = _script(tmp_path, INIT_ONLY, {"SM_HP_MP_PARAMETERS": json.dumps({"partitions": 2, "ddp": True})})
    assert_names_cause_and_fix(
        _config_failure(done),
        ["pipeline_parallel_degree(2) * tensor_parallel_degree(1) = 2 exceeds world_size(1)"],
        ["start a multiple of 2 processes", "or lower the degrees"],
    )


def test_world_size_in_validate(capsys):
    code = smp2ds(["validate", str(ROOT / "examples/configs/bert_pipeline_000.json"), "--world-size", "3"])
    out = capsys.readouterr().out
    assert code == 1
    assert "world_size(3) is not divisible by pipeline_parallel_degree(2)" in out
    assert "start a multiple of 2 processes" in out


def test_invalid_sm_hp_mp_parameters(tmp_path):
    done = _script(tmp_path, INIT_ONLY, {"SM_HP_MP_PARAMETERS": '{"ddp": true,'})
    assert_names_cause_and_fix(_config_failure(done), ["SM_HP_MP_PARAMETERS is not valid JSON", "line 1, column 14"],
                               ["set it to one JSON object", "smp2ds launch --config FILE"])


def test_model_created_before_smp_init(tmp_path):
    done = _script(tmp_path, MODEL_FIRST, {"SM_HP_MP_PARAMETERS": "{}"})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]  # a programming mistake: the traceback shows the line
    assert_names_cause_and_fix(last, ["NotInitializedError", "smp.init() has not been called"], ["call it first"])


def test_sdp_with_tensor_parallelism_without_prescaled_batch(tmp_path, capsys):
    config = tmp_path / "smp.json"
    config.write_text(json.dumps({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "ddp": True}))
    assert smp2ds(["validate", str(config), "--world-size", "4"]) == 1  # validate says what smp.init refuses
    out = capsys.readouterr().out
    assert "/tensor_parallel_degree: tensor_parallel_degree is not supported" in out
    assert "needs prescaled_batch: true" in out and "set prescaled_batch: true" in out
    config.write_text(json.dumps({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "ddp": True,
                                  "prescaled_batch": True}))
    assert smp2ds(["validate", str(config), "--world-size", "4"]) == 0


def _fake_install(tmp_path: Path, version: str) -> str:
    """A pip install record of another DeepSpeed version, found before the real one on sys.path."""
    info = tmp_path / "site" / f"deepspeed-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    return str(tmp_path / "site")


def test_deepspeed_too_old(tmp_path):
    done = _script(tmp_path, INIT_ONLY, {"SM_HP_MP_PARAMETERS": "{}"}, pythonpath=_fake_install(tmp_path, "0.14.0"))
    assert_names_cause_and_fix(_config_failure(done), ["DeepSpeed 0.14.0 is installed", "needs DeepSpeed >= 0.19.7"],
                               ["pip install 'deepspeed>=0.19.7'"])


@pytest.mark.parametrize("version", ["0.19.7", "0.19.10", "1.0.0+cu121", "local-build"])
def test_supported_or_unreadable_deepspeed_versions_pass(version):
    require_deepspeed(version)


@pytest.mark.parametrize("version", [None, "0.19.6", "0.9.99"])
def test_missing_or_older_deepspeed_is_refused(version):
    with pytest.raises(SMPUnsupportedError, match="0.19.7"):
        require_deepspeed(version)


def test_release_numbers_compare_as_numbers():
    assert release("0.19.10") > release("0.19.9")
    assert release("0.19.8+cpu") == (0, 19, 8)
