"""Launcher section: SageMaker-style environment, hostfile and the three command lines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from smp2ds.translator.model import Layout
from smp2ds.translator.normalize import normalize
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
