"""``smp2ds doctor`` run as users run it (a subprocess) in real environments that differ in one fact.

Each environment is real: launch variables set in the process environment, a GPU count through
``SMP2DS_NUM_GPUS`` (the override ``smp2ds launch`` honours too), an old DeepSpeed through a
``.dist-info`` record earlier on ``sys.path`` (what ``importlib.metadata`` reads for any
installed package), an empty torch extensions cache and a PATH without a compiler. Nothing in
smp2ds is patched. The judging rules are also called directly with the facts of machines we do
not have (a GPU node), since they are pure functions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from smp2ds.translator.tools import doctor as rules

ROOT = Path(__file__).resolve().parents[2]


def doctor(*argv: str, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "SM_HP_MP_PARAMETERS", "SMP2DS_NUM_GPUS", *drop)}
    return subprocess.run([sys.executable, "-m", "smp2ds.cli", "doctor", *argv],
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=120, cwd=ROOT)


def findings(proc: subprocess.CompletedProcess) -> list[dict[str, str]]:
    return json.loads(proc.stdout)["findings"]


def problems(proc: subprocess.CompletedProcess) -> list[dict[str, str]]:
    return [f for f in findings(proc) if f["status"] == "problem"]


def test_versions_are_this_environments_and_json_agrees_with_exit_code():
    proc = doctor("--format", "json")
    report = json.loads(proc.stdout)
    by_check = {f["check"]: f for f in report["findings"]}
    for name in ("torch", "deepspeed", "transformers"):
        assert by_check[name]["detail"].startswith(metadata.version(name))
    assert report["ok"] == (proc.returncode == 0) == (not problems(proc))


def test_doctor_imports_neither_torch_nor_deepspeed():
    # The speed promise: no torch/DeepSpeed import (seconds each) and no op build.
    code = ("import sys; from smp2ds.cli import main; rc = main(['doctor', '--format', 'json']); "
            "print('HEAVY', sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_rank_without_world_size_is_a_problem_with_a_fix():
    proc = doctor(env={"RANK": "0"})
    assert proc.returncode == 1
    line = next(x for x in proc.stdout.splitlines() if "RANK is set but WORLD_SIZE is not" in x)
    assert line.startswith("PROBLEM") and "fix:" in line and "torchrun" in line
    assert proc.stdout.rstrip().endswith("problem(s)")


def test_rank_outside_world_and_bad_local_size():
    proc = doctor("--format", "json", env={"RANK": "4", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3",
                                           "MASTER_ADDR": "127.0.0.1"})
    details = [f["detail"] for f in problems(proc)]
    assert any("RANK=4 is outside WORLD_SIZE=4" in d for d in details)
    assert any("ranks per node 3" in d and "WORLD_SIZE=4" in d for d in details)
    assert proc.returncode == 1


def test_layout_larger_than_visible_gpus(tmp_path):
    config = tmp_path / "smp.json"
    config.write_text(json.dumps({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True}))
    proc = doctor("--config", str(config), "--format", "json", env={"SMP2DS_NUM_GPUS": "2"})
    layout = [f for f in problems(proc) if f["check"] == "layout"]
    assert layout and "4 ranks" in layout[0]["detail"] and "--nodes 2" in layout[0]["fix"]
    assert proc.returncode == 1
    # The same layout over two such nodes fits.
    proc = doctor("--config", str(config), "--nodes", "2", "--format", "json", env={"SMP2DS_NUM_GPUS": "2"})
    assert not [f for f in problems(proc) if f["check"] == "layout"]


def test_invalid_config_and_sm_hp_mp_parameters(tmp_path):
    proc = doctor("--format", "json", env={"SM_HP_MP_PARAMETERS": '{"partitions": 2,'})
    assert [f["check"] for f in problems(proc)] == ["SM_HP_MP_PARAMETERS"] and "not JSON" in problems(proc)[0]["detail"]
    proc = doctor("--format", "json", env={"SM_HP_MP_PARAMETERS": '{"partitions": 3}', "WORLD_SIZE": "4",
                                           "RANK": "0", "MASTER_ADDR": "127.0.0.1"})
    bad = problems(proc)
    assert bad and bad[0]["check"] == "SM_HP_MP_PARAMETERS" and "world_size(4)" in bad[0]["detail"]
    assert proc.returncode == 1


def test_an_old_deepspeed_is_refused(tmp_path):
    # A dist-info record for deepspeed 0.10.0 ahead of site-packages: importlib.metadata reports it
    # exactly as it reports a real install of that release.
    info = tmp_path / "deepspeed-0.10.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.10.0\n")
    proc = doctor("--format", "json", env={"PYTHONPATH": str(tmp_path)})
    ds = next(f for f in findings(proc) if f["check"] == "deepspeed")
    assert ds["status"] == "problem" and "0.10.0" in ds["detail"] and rules.TESTED["deepspeed"].floor in ds["fix"]
    assert proc.returncode == 1


def test_unbuilt_comm_op_without_compiler_is_a_problem(tmp_path):
    # An empty JIT cache and a PATH without a C++ compiler: DeepSpeed would fail to build its CPU comm op
    # (unless this DeepSpeed was installed with the op prebuilt).
    bare = tmp_path / "bin"
    bare.mkdir()
    # SMP2DS_NUM_GPUS=0: the CPU path (the one that needs the comm op) also on a GPU machine.
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"), "PATH": str(bare), "SMP2DS_NUM_GPUS": "0"}
    from deepspeed.git_version_info import installed_ops  # DeepSpeed's own record of prebuilt ops

    if installed_ops.get("deepspeed_shm_comm"):
        pytest.skip("this DeepSpeed was installed with its CPU comm op prebuilt")
    proc = doctor("--format", "json", env=env, drop=("CXX",))
    op = next(f for f in findings(proc) if f["check"] == "op deepspeed_shm_comm")
    assert op["status"] == "problem" and "no C++ compiler" in op["detail"] and proc.returncode == 1
    # With the compiler on PATH again it is only a warning: DeepSpeed compiles it on first use.
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return  # no compiler on this machine's PATH either: the warning case cannot be shown here
    proc = doctor("--format", "json", env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "cache"), "SMP2DS_NUM_GPUS": "0"})
    op = next(f for f in findings(proc) if f["check"] == "op deepspeed_shm_comm")
    assert op["status"] == "warn" and "ShareMemCommBuilder" in op["fix"]


# --- the pure rules, with the facts of machines this test does not run on ---

GPU_NODE = rules.Machine(gpus=8, torch_cuda=True, nccl=True, cpus=96, mpirun=None, compiler="/usr/bin/c++")


def test_gpu_rules():
    assert [f.status for f in rules.check_devices(GPU_NODE)] == ["ok", "ok"]
    cpu_torch = rules.Machine(**{**GPU_NODE.__dict__, "torch_cuda": False})
    assert [f.check for f in rules.check_devices(cpu_torch) if f.status == "problem"] == ["cuda"]
    no_nccl = rules.Machine(**{**GPU_NODE.__dict__, "nccl": False})
    assert [f.check for f in rules.check_devices(no_nccl) if f.status == "problem"] == ["nccl"]
    assert rules.check_layout(16, 8, GPU_NODE, 1)[0].status == "problem"
    assert rules.check_layout(16, 8, GPU_NODE, 2)[0].status == "ok"
    assert rules.check_layout(16, 16, GPU_NODE, 2)[0].status == "problem"  # 16 per node on 8 GPUs


def test_ops_follow_the_config():
    assert rules.ops_needed(GPU_NODE, {"optimizer": {"type": "AdamW"}}) == {
        "fused_adam": "the config asks DeepSpeed for Adam on GPU"}
    offload = {"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert list(rules.ops_needed(GPU_NODE, offload)) == ["cpu_adam"]
    assert rules.ops_needed(GPU_NODE, {}) == {}


@pytest.mark.parametrize(("have", "status"), [("0.19.6", "problem"), ("0.19.7", "ok"), ("0.19.8rc1", "ok"),
                                               ("0.20.0", "warn"), (None, "problem")])
def test_version_table_is_injectable(have, status):
    table = {"deepspeed": rules.Tested("0.19.7", "0.19.8")}
    [finding] = rules.check_versions({"deepspeed": have}, table)
    assert finding.status == status
    assert rules.exit_code([finding]) == (status == "problem")


@pytest.mark.parametrize(("have", "status"), [("2.0.1", "problem"), ("2.8.0", "warn"), ("2.13.0+cpu", "ok")])
def test_torch_installs_from_its_floor_but_is_tested_on_one_release(have, status):
    """torch installs from 2.1 (pip must not replace a GPU build) but the suite runs 2.13 only: below that a
    warning that says so, not the claim that the range is tested."""
    [finding] = rules.check_versions({"torch": have}, {"torch": rules.TESTED["torch"]})
    assert finding.status == status
    assert "tested 2.13.0 .. 2.13.0" in finding.detail
