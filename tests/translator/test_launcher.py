"""Launcher section: SageMaker-style environment, hostfile and the three command lines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan

ESTIMATOR = {
    "instance_type": "ml.p4d.24xlarge",
    "instance_count": 2,
    "hyperparameters": {"train_batch_size": 8, "model_type": "gpt2"},
    "distribution": {
        "mpi": {
            "enabled": True,
            "processes_per_host": 8,
            "custom_mpi_options": "-x FI_PROVIDER=efa -x RDMAV_FORK_SAFE=1",
        },
        "smdistributed": {
            "modelparallel": {
                "enabled": True,
                "parameters": {
                    "pipeline_parallel_degree": 2,
                    "microbatches": 4,
                    "ddp": True,
                    "ddp_port": 4321,
                },
            }
        },
    },
}


@pytest.fixture(scope="module")
def launcher():
    return plan(normalize(ESTIMATOR)).launcher


def test_mp_parameters_env_is_compact_sorted_json_smp_reads_back(launcher):
    text = launcher["env"]["SM_HP_MP_PARAMETERS"]
    params = json.loads(text)
    assert text == json.dumps(params, sort_keys=True, separators=(",", ":"))
    given = ESTIMATOR["distribution"]["smdistributed"]["modelparallel"]["parameters"]
    # partitions is added (Hugging Face looks for it) and agrees with pipeline_parallel_degree
    assert params == {**given, "partitions": 2}
    # SMP's smp.init reads this env: it must normalize to the same configuration
    assert normalize(params).params == normalize(ESTIMATOR).params


def test_framework_params_and_sagemaker_variables(launcher):
    env = launcher["env"]
    framework = json.loads(env["SM_FRAMEWORK_PARAMS"])
    assert framework == {
        "sagemaker_distributed_dataparallel_enabled": False,
        "sagemaker_instance_type": "ml.p4d.24xlarge",
        "sagemaker_mpi_custom_mpi_options": "-x FI_PROVIDER=efa -x RDMAV_FORK_SAFE=1",
        "sagemaker_mpi_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 8,
    }
    assert json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"] and env["SM_NUM_GPUS"] == "8"
    assert env["SM_HP_MODEL_TYPE"] == "gpt2" and env["SM_HP_TRAIN_BATCH_SIZE"] == "8"
    assert json.loads(env["SM_HPS"])["mp_parameters"] == json.loads(env["SM_HP_MP_PARAMETERS"])


def test_hugging_face_detects_smp_from_the_env(launcher, monkeypatch):
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    for name in ("SM_HP_MP_PARAMETERS", "SM_FRAMEWORK_PARAMS"):
        monkeypatch.setenv(name, launcher["env"][name])
    assert import_utils.is_sagemaker_mp_enabled()
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", json.dumps({"pipeline_parallel_degree": 2}))
    assert not import_utils.is_sagemaker_mp_enabled()  # why partitions is added


def test_hostfile_and_commands(launcher):
    assert launcher["hostfile"] == "algo-1 slots=8\nalgo-2 slots=8\n"
    ds = launcher["deepspeed"]
    # The script gets the estimator's hyperparameters as SageMaker passes them: sorted --key value.
    script_argv = ["train.py", "--model_type", "gpt2", "--train_batch_size", "8"]
    assert ds[0] == "deepspeed" and ds[-5:] == script_argv
    assert launcher["torchrun"][-5:] == script_argv
    for flag, value in (
        ("--hostfile", "hostfile"),
        ("--num_nodes", "2"),
        ("--num_gpus", "8"),
        ("--master_addr", "algo-1"),
        ("--master_port", "4321"),
    ):
        assert ds[ds.index(flag) + 1] == value
    tr = launcher["torchrun"]
    for flag, value in (("--nnodes", "2"), ("--nproc-per-node", "8"), ("--master-port", "4321")):
        assert tr[tr.index(flag) + 1] == value
    mpi = launcher["mpirun"]
    assert mpi[mpi.index("-np") + 1] == "16" and mpi[mpi.index("--host") + 1] == "algo-1:8,algo-2:8"
    assert mpi[-6:] == ["python", *script_argv]
    custom = ["-x", "FI_PROVIDER=efa", "-x", "RDMAV_FORK_SAFE=1"]
    start = mpi.index("FI_PROVIDER=efa") - 1
    assert mpi[start : start + 4] == custom
    exported = {mpi[i + 1] for i, tok in enumerate(mpi) if tok == "-x"}
    assert set(launcher["env"]) <= exported


def test_single_node_deepspeed_command_has_no_hostfile():
    lay = Layout(world_size=2)
    ds = plan(normalize({"ddp": True}, lay), lay).launcher["deepspeed"]
    assert "--hostfile" not in ds and ds[ds.index("--num_gpus") + 1] == "2"


def test_v2_parameters_are_passed_without_partitions():
    lay = Layout(world_size=4)
    env = plan(normalize({"hybrid_shard_degree": 2}, lay), lay).launcher["env"]
    assert json.loads(env["SM_HP_MP_PARAMETERS"]) == {"hybrid_shard_degree": 2}


_PROBE = (
    "import json, os\n"
    "from smp2ds.translator.normalize import normalize\n"
    "cfg = normalize(json.loads(os.environ['SM_HP_MP_PARAMETERS']))\n"
    "rank = os.environ['OMPI_COMM_WORLD_RANK']\n"
    "with open(os.path.join(os.path.dirname(__file__), f'rank{rank}.txt'), 'w') as f:\n"
    "    f.write(f\"{rank} {cfg.pipeline_parallel_degree} {os.environ['MASTER_PORT']}\")\n"
)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI not installed")
def test_the_mpirun_command_runs_under_real_open_mpi(tmp_path):
    lay = Layout(world_size=2, gpus_per_node=2)
    launcher = plan(
        normalize({"partitions": 2, "microbatches": 2, "ddp_port": 4321, "ddp": True}, lay), lay
    ).launcher
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    # The plan's argv with the SageMaker host name made local and the placeholder script replaced.
    argv = [tok.replace("algo-1", "localhost") for tok in launcher["mpirun"]]
    argv[-2:] = [sys.executable, str(script)]
    out = subprocess.run(
        argv, env={**os.environ, **launcher["env"]}, capture_output=True, text=True, timeout=180, check=False
    )
    assert out.returncode == 0, out.stderr
    # each rank wrote what it saw: its MPI rank, the config SMP would load, the rendezvous port
    assert sorted(f.read_text() for f in tmp_path.glob("rank*.txt")) == ["0 2 4321", "1 2 4321"]


# ---------------------------------------------------------------------------------------------
# the same builder serves `smp2ds launch`: pure, machine facts passed in


def _local(launcher, **overrides):
    from smp2ds.translator.launcher import local_environment

    args = dict(
        instance_type="ml.p4d.24xlarge",
        nproc=2,
        nnodes=2,
        node_rank=1,
        gpus=0,
        script=["-m", "pkg.train", "--lr", "1"],
        output_dir="/out",
        channels={"train": "/data/train"},
        addr="10.0.0.1",
        port=4321,
        environ={"SM_MODEL_DIR": "/keep/model", "SM_NETWORK_INTERFACE_NAME": "ens5"},
        cpu_count=3,
    )
    args.update(overrides)
    return local_environment(launcher["env"], **args)


def test_local_environment_keeps_the_plans_smp_variables_and_describes_this_machine(launcher, monkeypatch):
    monkeypatch.setenv("SM_OUTPUT_DIR", "/not/read")  # only the `environ` passed in counts
    env = _local(launcher)
    assert list(env) == sorted(env)
    assert env["SM_HP_MP_PARAMETERS"] == launcher["env"]["SM_HP_MP_PARAMETERS"]
    assert env["SM_HPS"] == launcher["env"]["SM_HPS"]
    framework = json.loads(env["SM_FRAMEWORK_PARAMS"])
    assert framework["sagemaker_mpi_num_of_processes_per_host"] == 2
    assert framework["sagemaker_distributed_dataparallel_enabled"] is False
    assert env["SM_CURRENT_HOST"] == "algo-2" and env["SM_NUM_CPUS"] == "3" and env["SM_NUM_GPUS"] == "0"
    assert env["SM_MODEL_DIR"] == "/keep/model" and env["SM_OUTPUT_DIR"] == "/out/output"
    assert env["SM_NETWORK_INTERFACE_NAME"] == "ens5"
    assert env["SM_USER_ENTRY_POINT"] == "pkg.train" and json.loads(env["SM_USER_ARGS"]) == ["--lr", "1"]
    assert env["SM_CHANNEL_TRAIN"] == "/data/train" and json.loads(env["SM_CHANNELS"]) == ["train"]
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["DS_ACCELERATOR"]) == ("10.0.0.1", "4321", "cpu")


def test_local_environment_without_a_config():
    env = _local({"env": None}, instance_type=None, gpus=8, nnodes=1, node_rank=0)
    assert json.loads(env["SM_FRAMEWORK_PARAMS"]) == {
        "sagemaker_distributed_dataparallel_enabled": False,
        "sagemaker_instance_type": "local",
        "sagemaker_mpi_custom_mpi_options": "",
        "sagemaker_mpi_enabled": True,
        "sagemaker_mpi_num_of_processes_per_host": 2,
    }
    assert env["SM_HPS"] == "{}" and env["SM_NETWORK_INTERFACE_NAME"] == "lo"
    assert "DS_ACCELERATOR" not in env and "SM_HP_MP_PARAMETERS" not in env


def test_hyperparameters_go_right_after_the_entry_point():
    from smp2ds.translator.launcher import with_hyperparameters

    hps = {"b": 2, "a": {"y": 1, "x": 0}}
    assert with_hyperparameters(["t.py", "--a", "9"], hps) == ["t.py", "--a", "x=0,y=1", "--b", "2", "--a", "9"]
    assert with_hyperparameters(["-m", "pkg", "--c"], hps)[:3] == ["-m", "pkg", "--a"]


def test_local_launcher_commands():
    from smp2ds.translator.launcher import launcher_command

    common = dict(nproc=2, nnodes=1, node_rank=0, addr="127.0.0.1", port=7, env_names=["A", "B"], hostfile=None)
    ds = launcher_command("deepspeed", ["-m", "pkg", "--x"], program=["ds"], python="py", **common)
    assert ds == ["ds", "--num_gpus", "2", "--master_port", "7", "--no_local_rank", "--module", "pkg", "--x"]
    mpi = launcher_command("mpirun", ["t.py"], program=["mpirun"], python="py", **common)
    assert mpi[0] == "mpirun" and mpi[-6:] == ["-x", "A", "-x", "B", "py", "t.py"]
    with pytest.raises(ValueError, match="-m"):
        launcher_command("torchrun", ["-m"], program=["torchrun"], python="py", **common)
