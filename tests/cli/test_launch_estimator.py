"""``smp2ds launch --estimator FILE`` for an estimator on several instances, the migration guide's main recipe,
with the exact estimator that broke it (``examples/configs/gpt2_30b_sdp_002.json``: 32 x ml.p4d.24xlarge, 8
processes per host, sharded_data_parallel_degree 128): without ``--nnodes`` it says how to start each node; with
``--nnodes 32 --node-rank R --master-addr A`` it plans for 256 ranks and runs the estimator's ``entry_point`` (under
its ``source_dir``) with its hyperparameters when no script is given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smp2ds.cli import main

ESTIMATOR = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "gpt2_30b_sdp_002.json")


@pytest.fixture(autouse=True)
def eight_gpus(monkeypatch):
    monkeypatch.setenv("SMP2DS_NUM_GPUS", "8")  # a p4d's GPUs, on a login node without any


def test_several_instances_without_nnodes_say_how_to_start_each_node(capsys):
    assert main(["launch", "--estimator", ESTIMATOR, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "instance_count 32" in err and "--nnodes 32 --node-rank R (R = 0..31" in err and "--master-addr" in err


def test_each_node_runs_the_entry_point_in_the_estimators_world(capsys):
    argv = ["launch", "--estimator", ESTIMATOR, "--nnodes", "32", "--node-rank", "3", "--master-addr", "10.0.0.1",
            "--launcher", "torchrun", "--dry-run", "--format", "json"]
    assert main(argv) == 0
    spec = json.loads(capsys.readouterr().out)
    command = spec["command"]
    script = command.index("gpt2/train_gpt_simple.py")
    assert command[script + 1:script + 3] == ["--activation_checkpointing", "1"]
    assert "--nnodes" in command and command[command.index("--nnodes") + 1] == "32"
    assert command[command.index("--node-rank") + 1] == "3"
    assert spec["env"]["SM_CURRENT_HOST"] == "algo-4" and len(json.loads(spec["env"]["SM_HOSTS"])) == 32
    assert json.loads(spec["env"]["SM_HP_MP_PARAMETERS"])["sharded_data_parallel_degree"] == 128


def test_one_node_on_purpose_checks_the_config_for_one_node(capsys):
    assert main(["launch", "--estimator", ESTIMATOR, "--nnodes", "1", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "sharded_data_parallel_degree" in err and "128" in err


def test_accelerate_refuses_pipeline_parallelism_naming_the_routes_that_work(tmp_path, capsys):
    """accelerate has no pipeline stages (its mesh: data, shard, tensor, context); the config used to come out
    without them. Tensor parallelism alone goes to FSDP2's tp_size (tests/cli/test_accelerate_fsdp2.py)."""
    config = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "gpt3_175b_tp_pp_004.json")
    out = tmp_path / "run.yaml"
    assert main(["convert", config, "--to", "accelerate", "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert "/pipeline_parallel_degree: pipeline_parallel_degree" in err and "cannot be carried to accelerate" in err
    assert "smp2ds checkpoint export --to hf" in err and not out.exists()


def test_convert_maps_sagemakers_paths_to_local_folders(tmp_path, capsys):
    """An estimator whose hyperparameters point at SageMaker's container paths, converted with the folders they
    map to: no /opt/ml path is left in the script, and the SM_* folders point at the given ones."""
    spec = {"entry_point": "train.py", "instance_type": "ml.g5.12xlarge", "instance_count": 1,
            "hyperparameters": {"checkpoint-dir": "/opt/ml/checkpoints", "model-dir": "/opt/ml/model",
                                "train": "/opt/ml/input/data/train"},
            "distribution": {"mpi": {"enabled": True, "processes_per_host": 2},
                             "smdistributed": {"modelparallel": {"enabled": True, "parameters": {"ddp": True}}}}}
    path = tmp_path / "estimator.json"
    path.write_text(json.dumps(spec))
    out, ckpt, train = tmp_path / "job", tmp_path / "ckpt", tmp_path / "train"
    argv = ["convert", str(path), "--to", "torchrun", "--format", "json", "--output-dir", str(out),
            "--checkpoint-dir", str(ckpt), "--channel", f"train={train}"]
    assert main(argv) == 0
    launch = json.loads(capsys.readouterr().out)
    assert "/opt/ml" not in json.dumps(launch)
    command = launch["command"]
    assert command[command.index("--checkpoint-dir") + 1] == str(ckpt)
    assert command[command.index("--model-dir") + 1] == str(out / "model")
    assert launch["env"]["SM_MODEL_DIR"] == str(out / "model") and launch["env"]["SM_CHANNEL_TRAIN"] == str(train)
    assert main(["convert", str(path), "--to", "deepspeed", "--output-dir", str(out)]) == 2
    assert "use them with --to torchrun" in capsys.readouterr().err
