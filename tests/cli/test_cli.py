"""Acceptance tests of the ``smp2ds`` command line: exit codes, messages, files, stdin, launch.

Most tests call ``main(argv)`` in-process (fast); the ones marked ``console`` run the installed
console script as a subprocess, which is what users run, to prove exit codes and the absence of
Python tracebacks end to end.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from smp2ds.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "configs"
DOCS_EXAMPLE = EXAMPLES / "docs_example_001.json"  # partitions 2 x ddp on 8 processes

# An SMP parameters dict with two mistakes: a misspelt key and a value of the wrong type.
INVALID_PARAMS = {"partitions": 2, "microbatch": 4, "pipeline": "fast"}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def write_json(path: Path, value: object) -> str:
    path.write_text(json.dumps(value), encoding="utf-8")
    return str(path)


def console() -> list[str]:
    """The installed console script (next to this interpreter), as users run it."""
    beside = Path(sys.executable).with_name("smp2ds")
    found = str(beside) if beside.exists() else shutil.which("smp2ds")
    if not found:
        pytest.fail("the smp2ds console script is not installed (pip install -e . --no-deps)")
    return [found]


def run_console(
    args: list[str], stdin: str | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        console() + args,
        check=False,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


# ---------------------------------------------------------------------------------------------
# usage


def test_help_lists_every_subcommand(capsys):
    code, out, _ = run(["--help"], capsys)
    assert code == 0
    for name in ("validate", "convert", "explain", "launch"):
        assert name in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["convert"],
        ["convert", "x.json", "--to", "pytorch"],
        ["convert", "x.json", "--world-size", "0"],
        ["convert", "x.json", "--world-size", "2.5"],
        ["explain", "x.json", "--params", "lots"],
        ["validate", "x.json", "--format", "yaml"],
    ],
)
def test_usage_errors_exit_2(argv, capsys):
    code, out, err = run(argv, capsys)
    assert code == 2
    assert "usage: smp2ds" in err
    assert out == ""


def test_missing_file_exits_2_naming_the_path(tmp_path, capsys):
    missing = str(tmp_path / "nope.json")
    for command in ("validate", "convert", "explain"):
        code, out, err = run([command, missing], capsys)
        assert code == 2, command
        assert missing in err
        assert "Traceback" not in err + out


def test_directory_as_file_exits_2(tmp_path, capsys):
    code, _, err = run(["convert", str(tmp_path)], capsys)
    assert code == 2
    assert str(tmp_path) in err


# ---------------------------------------------------------------------------------------------
# validate


def test_validate_valid_example(capsys):
    code, out, _ = run(["validate", str(DOCS_EXAMPLE)], capsys)
    assert code == 0
    assert "valid SMP configuration" in out


def test_validate_reports_every_issue_with_pointer_and_hint(tmp_path, capsys):
    path = write_json(tmp_path / "bad.json", INVALID_PARAMS)
    code, out, _ = run(["validate", path], capsys)
    assert code == 1
    assert "/microbatch" in out
    assert "/pipeline" in out
    assert "hint:" in out and "microbatches" in out  # the misspelling gets a did-you-mean
    assert "given:" in out and '"fast"' in out
    assert "allowed:" in out and "interleaved" in out


def test_validate_json_lists_issues(tmp_path, capsys):
    path = write_json(tmp_path / "bad.json", INVALID_PARAMS)
    code, out, _ = run(["validate", path, "--format", "json"], capsys)
    assert code == 1
    report = json.loads(out)
    assert report["valid"] is False
    pointers = {issue["pointer"] for issue in report["issues"]}
    assert {"/microbatch", "/pipeline"} <= pointers
    by_pointer = {issue["pointer"]: issue for issue in report["issues"]}
    assert by_pointer["/pipeline"]["given"] == "fast"
    assert "microbatches" in by_pointer["/microbatch"].get("hint", "")


def test_validate_json_valid(capsys):
    code, out, _ = run(["validate", str(DOCS_EXAMPLE), "--format", "json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["valid"] is True and report["issues"] == []
    assert report["kind"] == "estimator"


def test_validate_world_size_arithmetic(tmp_path, capsys):
    # pipeline_parallel_degree 4 cannot split a world of 6 ranks.
    path = write_json(tmp_path / "p.json", {"partitions": 4, "ddp": True})
    code, _, _ = run(["validate", path, "--world-size", "8"], capsys)
    assert code == 0
    code, out, _ = run(["validate", path, "--world-size", "6"], capsys)
    assert code == 1
    assert "/partitions" in out and "world_size(6)" in out


def test_malformed_json_exits_1_with_line_and_column(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text('{\n  "partitions": 2,\n  "ddp": True\n}\n', encoding="utf-8")
    code, out, _ = run(["validate", str(path)], capsys)
    assert code == 1
    assert "line 3" in out
    assert "true" in out  # the hint spells Python's True the JSON way


def test_duplicate_keys_are_invalid(tmp_path, capsys):
    path = tmp_path / "dup.json"
    path.write_text('{"partitions": 2, "partitions": 4}', encoding="utf-8")
    code, _, err = run(["convert", str(path)], capsys)
    assert code == 1
    assert "/partitions" in err and "duplicate" in err


# ---------------------------------------------------------------------------------------------
# convert


def test_convert_default_is_deepspeed_json(capsys):
    code, out, err = run(["convert", str(DOCS_EXAMPLE)], capsys)
    assert code == 0
    ds = json.loads(out)  # stdout is exactly the DeepSpeed config
    assert "gradient_clipping" in ds
    assert "mapped" in err  # the key-fate summary goes to stderr, not into the file


def test_convert_invalid_exits_1_issues_on_stderr(tmp_path, capsys):
    path = write_json(tmp_path / "bad.json", INVALID_PARAMS)
    code, out, err = run(["convert", path], capsys)
    assert code == 1
    assert out == ""
    assert "/microbatch" in err and "hint:" in err


def test_convert_invalid_json_format_reports_issues_as_json(tmp_path, capsys):
    path = write_json(tmp_path / "bad.json", INVALID_PARAMS)
    code, out, err = run(["convert", path, "--format", "json"], capsys)
    assert code == 1 and out == ""
    report = json.loads(err)
    assert report["valid"] is False
    assert "/microbatch" in {issue["pointer"] for issue in report["issues"]}


def test_convert_plan_json_has_six_sections(capsys):
    code, out, _ = run(["convert", str(DOCS_EXAMPLE), "--to", "plan", "--format", "json"], capsys)
    assert code == 0
    plan = json.loads(out)
    assert set(plan) == {"topology", "deepspeed", "engine", "megatron", "launcher", "notes"}


@pytest.mark.parametrize("target", ["megatron", "launcher"])
def test_convert_other_targets_json(target, capsys):
    code, out, _ = run(["convert", str(DOCS_EXAMPLE), "--to", target, "--format", "json"], capsys)
    assert code == 0
    assert isinstance(json.loads(out), dict)


def test_convert_plan_text_mentions_every_section(capsys):
    code, out, _ = run(["convert", str(DOCS_EXAMPLE), "--to", "plan"], capsys)
    assert code == 0
    for section in ("topology:", "deepspeed:", "engine:", "megatron:", "launcher:", "keys ("):
        assert section in out


def test_output_file_and_overwrite(tmp_path, capsys):
    out_path = tmp_path / "ds.json"
    code, out, _ = run(["convert", str(DOCS_EXAMPLE), "-o", str(out_path)], capsys)
    assert code == 0 and out == ""
    first = json.loads(out_path.read_text())
    assert "gradient_clipping" in first

    out_path.write_text("keep me", encoding="utf-8")
    code, _, err = run(["convert", str(DOCS_EXAMPLE), "-o", str(out_path)], capsys)
    assert code == 2
    assert "--overwrite" in err
    assert out_path.read_text() == "keep me"

    code, _, _ = run(["convert", str(DOCS_EXAMPLE), "-o", str(out_path), "--overwrite"], capsys)
    assert code == 0
    assert json.loads(out_path.read_text()) == first
    assert [p.name for p in tmp_path.iterdir()] == ["ds.json"]  # no temporary file left behind


def test_overwrite_without_output_is_usage_error(capsys):
    code, _, err = run(["convert", str(DOCS_EXAMPLE), "--overwrite"], capsys)
    assert code == 2
    assert "-o" in err


def test_output_into_missing_folder_exits_2(tmp_path, capsys):
    code, _, err = run(["convert", str(DOCS_EXAMPLE), "-o", str(tmp_path / "no" / "ds.json")], capsys)
    assert code == 2
    assert "Traceback" not in err


def test_stdin_dash(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(DOCS_EXAMPLE.read_text()))
    code, out, _ = run(["convert", "-", "--to", "plan", "--format", "json"], capsys)
    assert code == 0
    from_stdin = json.loads(out)
    code, out, _ = run(["convert", str(DOCS_EXAMPLE), "--to", "plan", "--format", "json"], capsys)
    assert json.loads(out)["deepspeed"] == from_stdin["deepspeed"]


def test_layout_flags_reach_the_plan(tmp_path, capsys):
    path = write_json(tmp_path / "p.json", {"partitions": 2, "microbatches": 4, "ddp": True})
    code, out, _ = run(
        [
            "convert",
            path,
            "--world-size",
            "4",
            "--gpus-per-node",
            "2",
            "--batch-size",
            "8",
            "--to",
            "plan",
            "--format",
            "json",
        ],
        capsys,
    )
    assert code == 0
    plan = json.loads(out)
    assert plan["topology"]["world_size"] == 4
    # per-rank batch 8 split into 4 micro-batches: DeepSpeed sees micro-batch 2, accumulation 4
    assert plan["deepspeed"]["train_micro_batch_size_per_gpu"] == 2
    assert plan["deepspeed"]["gradient_accumulation_steps"] == 4


# ---------------------------------------------------------------------------------------------
# explain


def test_explain_text_table_and_estimate(capsys):
    code, out, _ = run(["explain", str(EXAMPLES / "gpt2_30b_sdp_002.json"), "--params", "30e9"], capsys)
    assert code == 0
    assert "key" in out and "fate" in out and "target / reason" in out
    assert "sharded_data_parallel_degree" in out
    assert "GiB" in out  # per-rank model-state memory is shown with a unit


def test_explain_json(capsys):
    code, out, _ = run(
        ["explain", str(EXAMPLES / "gpt2_30b_sdp_002.json"), "--params", "30B", "--format", "json"], capsys
    )
    assert code == 0
    report = json.loads(out)
    keys = {note["key"]: note for note in report["keys"]}
    assert keys["sharded_data_parallel_degree"]["fate"] in ("mapped", "engine")
    assert sum(report["counts"].values()) == len(report["keys"])
    assert report["estimate"]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("30e9", 30_000_000_000),
        ("30B", 30_000_000_000),
        ("1.3b", 1_300_000_000),
        ("350M", 350_000_000),
        ("7", 7),
    ],
)
def test_params_spellings(text, expected):
    from smp2ds.cli.explain import parameter_count

    assert parameter_count(text) == expected


# ---------------------------------------------------------------------------------------------
# launch (dry run)


def dry_run(argv: list[str], capsys, monkeypatch, gpus: str = "0") -> tuple[int, dict, str]:
    monkeypatch.setenv("SMP2DS_NUM_GPUS", gpus)
    code, out, err = run(["launch", "--dry-run", "--format", "json", *argv], capsys)
    return code, (json.loads(out) if code == 0 else {}), err


def test_launch_dry_run_sets_sagemaker_env(tmp_path, capsys, monkeypatch):
    config = write_json(tmp_path / "smp.json", {"partitions": 2, "microbatches": 4, "ddp": True})
    code, spec, _ = dry_run(
        ["--config", config, "--nproc-per-node", "2", "--", "train.py", "--lr", "0.1"], capsys, monkeypatch
    )
    assert code == 0
    env = spec["env"]
    mp = json.loads(env["SM_HP_MP_PARAMETERS"])
    assert mp["microbatches"] == 4 and mp["ddp"] is True
    assert mp.get("partitions", mp.get("pipeline_parallel_degree")) == 2
    framework = json.loads(env["SM_FRAMEWORK_PARAMS"])
    assert framework["sagemaker_mpi_enabled"] is True
    assert framework["sagemaker_mpi_num_of_processes_per_host"] == 2
    assert json.loads(env["SM_HOSTS"]) == ["algo-1"] and env["SM_CURRENT_HOST"] == "algo-1"
    assert env["SM_NUM_GPUS"] == "0" and env["DS_ACCELERATOR"] == "cpu"
    assert {"SM_MODEL_DIR", "SM_OUTPUT_DATA_DIR"} <= set(env)
    assert any("CPU" in n and "gloo" in n for n in spec["notices"])
    cmd = spec["command"]
    assert "--num_gpus" in cmd and cmd[cmd.index("--num_gpus") + 1] == "2"
    assert cmd[-3:] == ["train.py", "--lr", "0.1"]


def test_launch_dry_run_text_prints_exports(tmp_path, capsys, monkeypatch):
    config = write_json(tmp_path / "smp.json", {"partitions": 2, "ddp": True})
    monkeypatch.setenv("SMP2DS_NUM_GPUS", "0")
    code, out, _ = run(
        ["launch", "--config", config, "--nproc-per-node", "2", "--dry-run", "--", "t.py"], capsys
    )
    assert code == 0
    assert "export SM_HP_MP_PARAMETERS=" in out
    assert "CPU" in out


def test_launch_estimator_channels_and_hyperparameters(tmp_path, capsys, monkeypatch):
    code, spec, _ = dry_run(
        [
            "--estimator",
            str(EXAMPLES / "hf_glue_model_parallel_003.json"),
            "--nproc-per-node",
            "4",
            "--channel",
            f"train={tmp_path}",
            "--",
            "run_glue.py",
        ],
        capsys,
        monkeypatch,
    )
    assert code == 0
    env = spec["env"]
    assert env["SM_CHANNEL_TRAIN"] == str(tmp_path)
    assert json.loads(env["SM_CHANNELS"]) == ["train"]
    assert env["SM_HP_TASK_NAME"] == "mnli"
    assert json.loads(env["SM_HPS"])["per_device_train_batch_size"] == 16
    assert json.loads(env["SM_FRAMEWORK_PARAMS"])["sagemaker_instance_type"] == "ml.p3.16xlarge"
    # As on SageMaker, the script also receives the hyperparameters as sorted `--key value` args.
    cmd = spec["command"]
    script_args = cmd[cmd.index("run_glue.py") + 1:]
    assert script_args[:2] == ["--do_eval", "True"]
    assert script_args[script_args.index("--per_device_train_batch_size") + 1] == "16"
    assert script_args[script_args.index("--task_name") + 1] == "mnli"
    keys = [a for a in script_args if a.startswith("--")]
    assert keys == sorted(keys)


def test_launch_args_after_double_dash_follow_the_hyperparameters(tmp_path, capsys, monkeypatch):
    estimator = write_json(tmp_path / "est.json", {
        "instance_count": 1, "instance_type": "ml.p3.16xlarge",
        "hyperparameters": {"epochs": 1, "sizes": {"b": 2, "a": 1}},
        "distribution": {"smdistributed": {"modelparallel": {"enabled": True, "parameters": {"partitions": 1, "ddp": True}}},
                         "mpi": {"enabled": True, "processes_per_host": 2}},
    })
    code, spec, _ = dry_run(["--estimator", estimator, "--", "train.py", "--epochs", "3"], capsys, monkeypatch)
    assert code == 0
    cmd = spec["command"]
    assert cmd[cmd.index("train.py"):] == ["train.py", "--epochs", "1", "--sizes", "a=1,b=2", "--epochs", "3"]


def test_launch_torchrun_command(tmp_path, capsys, monkeypatch):
    config = write_json(tmp_path / "smp.json", {"partitions": 1, "ddp": True})
    code, spec, _ = dry_run(
        [
            "--config",
            config,
            "--launcher",
            "torchrun",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "7777",
            "--",
            "train.py",
        ],
        capsys,
        monkeypatch,
    )
    assert code == 0
    cmd = spec["command"]
    for flag, value in (
        ("--nproc-per-node", "2"),
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--master-addr", "10.0.0.1"),
        ("--master-port", "7777"),
    ):
        assert cmd[cmd.index(flag) + 1] == value
    assert spec["env"]["SM_CURRENT_HOST"] == "algo-2"
    assert json.loads(spec["env"]["SM_HOSTS"]) == ["algo-1", "algo-2"]


def test_launch_mpirun_exports_every_variable(tmp_path, capsys, monkeypatch):
    config = write_json(tmp_path / "smp.json", {"partitions": 2, "ddp": True})
    code, spec, _ = dry_run(
        ["--config", config, "--launcher", "mpirun", "--nproc-per-node", "2", "--", "t.py"],
        capsys,
        monkeypatch,
    )
    assert code == 0
    cmd = spec["command"]
    assert "--allow-run-as-root" in cmd and cmd[cmd.index("-np") + 1] == "2"
    exported = {cmd[i + 1] for i, token in enumerate(cmd) if token == "-x"}
    assert set(spec["env"]) <= exported
    assert cmd[-2:] == [sys.executable, "t.py"]


def test_launch_deepspeed_multinode_uses_hostfile(tmp_path, capsys, monkeypatch):
    code, spec, _ = dry_run(
        [
            "--launcher",
            "deepspeed",
            "--nproc-per-node",
            "2",
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--master-addr",
            "10.0.0.1",
            "--output-dir",
            str(tmp_path),
            "--",
            "t.py",
        ],
        capsys,
        monkeypatch,
    )
    assert code == 0
    cmd = spec["command"]
    assert "--no_ssh" in cmd and cmd[cmd.index("--node_rank") + 1] == "0"
    assert spec["hostfile"]["content"] == "algo-1 slots=2\nalgo-2 slots=2\n"
    assert cmd[cmd.index("--hostfile") + 1] == spec["hostfile"]["path"]


def test_launch_gpu_machine_has_no_cpu_notice(tmp_path, capsys, monkeypatch):
    code, spec, _ = dry_run(["--nproc-per-node", "2", "--", "t.py"], capsys, monkeypatch, gpus="8")
    assert code == 0
    assert "DS_ACCELERATOR" not in spec["env"] and spec["env"]["SM_NUM_GPUS"] == "8"
    assert not any("CPU" in n for n in spec["notices"])


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--nproc-per-node", "2"], "--"),
        (["--nnodes", "2", "--", "t.py"], "--master-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--", "t.py"], "--node-rank"),
        (["--launcher", "mpirun", "--nnodes", "2", "--master-addr", "h", "--", "t.py"], "ssh"),
        (["--channel", "train", "--", "t.py"], "NAME=PATH"),
        (["--", "-m"], "`-m` needs a module name"),
    ],
)
def test_launch_usage_errors(argv, needle, capsys, monkeypatch):
    monkeypatch.setenv("SMP2DS_NUM_GPUS", "0")
    code, _, err = run(["launch", "--dry-run", *argv], capsys)
    assert code == 2
    assert needle in err


def test_launch_config_invalid_for_world_exits_1(tmp_path, capsys, monkeypatch):
    config = write_json(tmp_path / "smp.json", {"partitions": 4, "ddp": True})
    monkeypatch.setenv("SMP2DS_NUM_GPUS", "0")
    code, out, err = run(
        ["launch", "--config", config, "--nproc-per-node", "2", "--dry-run", "--", "t.py"], capsys
    )
    assert code == 1
    assert out == "" and "partitions" in err


# ---------------------------------------------------------------------------------------------
# the installed console script, as a subprocess


@pytest.mark.parametrize(
    "args,code",
    [
        (["validate", str(DOCS_EXAMPLE)], 0),
        (["convert", str(DOCS_EXAMPLE), "--to", "plan", "--format", "json"], 0),
        (["explain", str(DOCS_EXAMPLE)], 0),
        (["convert", "/nonexistent/smp.json"], 2),
        (["convert", str(DOCS_EXAMPLE), "--to", "nowhere"], 2),
    ],
)
def test_console_script_exit_codes(args, code):
    proc = run_console(args)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr


def test_console_script_invalid_stdin_exits_1():
    proc = run_console(["validate", "-"], stdin=json.dumps(INVALID_PARAMS))
    assert proc.returncode == 1
    assert "/microbatch" in proc.stdout and "hint:" in proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout


def test_console_script_stdin_plan():
    proc = run_console(["convert", "-", "--to", "plan", "--format", "json"], stdin=DOCS_EXAMPLE.read_text())
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)) == {
        "topology",
        "deepspeed",
        "engine",
        "megatron",
        "launcher",
        "notes",
    }


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "smp2ds.cli", "validate", str(DOCS_EXAMPLE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_cli_never_imports_torch_or_deepspeed():
    probe = (
        "import sys\n"
        "from smp2ds.cli import main\n"
        f"assert main(['explain', {str(EXAMPLES / 'gpt2_30b_sdp_002.json')!r}, '--params', '30e9']) == 0\n"
        f"assert main(['convert', {str(DOCS_EXAMPLE)!r}, '--to', 'plan']) == 0\n"
        "assert main(['launch', '--dry-run', '--nproc-per-node', '2', '--', 't.py']) == 0\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'transformers'))\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# real launches: the launcher starts the ranks and each rank sees the SageMaker environment

RANK_SCRIPT = """
import json, os, sys
rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
seen = {k: os.environ.get(k) for k in ("SM_HP_MP_PARAMETERS", "SM_FRAMEWORK_PARAMS", "SM_CURRENT_HOST",
                                       "DS_ACCELERATOR", "MASTER_PORT")}
seen["argv"] = sys.argv[1:]
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as handle:
    json.dump(seen, handle)
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["mpirun", "torchrun", "deepspeed"])
def test_launch_runs_ranks_with_env(launcher, tmp_path):
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT, encoding="utf-8")
    config = write_json(tmp_path / "smp.json", {"partitions": 2, "microbatches": 2, "ddp": True})
    base = [
        "launch",
        "--config",
        config,
        "--launcher",
        launcher,
        "--nproc-per-node",
        "2",
        "--output-dir",
        str(tmp_path / "sm"),
        "--",
        str(script),
        str(tmp_path),
    ]
    env = {"SMP2DS_NUM_GPUS": "0", "OMP_NUM_THREADS": "1"}
    proc = run_console(base + ["0"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CPU" in proc.stderr  # the CPU/gloo notice
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert json.loads(seen["SM_HP_MP_PARAMETERS"])["microbatches"] == 2
        assert json.loads(seen["SM_FRAMEWORK_PARAMS"])["sagemaker_mpi_enabled"] is True
        assert seen["DS_ACCELERATOR"] == "cpu" and seen["SM_CURRENT_HOST"] == "algo-1"
        assert seen["argv"] == [str(tmp_path), "0"]  # no --local_rank injected
    assert (tmp_path / "sm" / "model").is_dir()

    failed = run_console(base + ["3"], env=env, timeout=300)
    assert failed.returncode != 0  # the ranks' failure is the launch's failure
