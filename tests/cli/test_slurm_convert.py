"""``smp2ds convert --to slurm`` and ``smp2ds launch`` inside a Slurm allocation, without Slurm.

The sbatch script exports exactly the environment of ``convert --to torchrun``; its shell part runs here with stand-ins
for ``scontrol`` and ``srun`` (srun starts each node's command with that node's ``SLURM_NODEID``) and a stand-in
``torchrun`` that reports its argv and environment, so the quoting, the master address, the hyphenated
hyperparameter names and each node's ``SM_CURRENT_HOST`` are checked as a shell sees them. ``launch`` takes its
node count, node rank, master address and processes per node from ``SLURM_*`` as accelerate and Lightning do.
The real cluster run is ``test_slurm_cluster.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from smp2ds.cli import main
from smp2ds.translator.tools.slurm_env import SlurmEnvError, expand_hostlist, launch_defaults
from tests.cli.convert_helpers import convert, write_stub

ESTIMATOR = {
    "entry_point": "train.py",
    "instance_type": "ml.p4d.24xlarge",
    "instance_count": 2,
    # a hyphenated name: SM_HP_CHECKPOINT-DIR, which no shell can export; and a value with a quote and a $
    "hyperparameters": {"checkpoint-dir": "/opt/ml/checkpoints", "note": "it's $HOME", "epochs": 2},
    "environment": {"FROM_ESTIMATOR": "carried"},
    "distribution": {"mpi": {"enabled": True, "processes_per_host": 8},
                     "smdistributed": {"modelparallel": {"enabled": True, "parameters": {
                         "ddp": True, "microbatches": 2, "tensor_parallel_degree": 2}}}},
}


@pytest.fixture
def estimator(tmp_path: Path) -> str:
    path = tmp_path / "gpt_job.json"
    path.write_text(json.dumps(ESTIMATOR), encoding="utf-8")
    return str(path)


def test_sbatch_script_asks_for_the_plans_nodes_and_starts_torchrun_once_per_node(estimator, capsys):
    text = convert([estimator, "--to", "slurm", "--sbatch=--partition=gpu", "--sbatch=--time=02:00:00"], capsys)
    assert text.startswith("#!/bin/bash\n#SBATCH --job-name=smp2ds-gpt_job\n#SBATCH --nodes=2\n"
                           "#SBATCH --ntasks-per-node=1\n#SBATCH --exclusive\n#SBATCH --gpus-per-node=8\n"
                           "#SBATCH --partition=gpu\n#SBATCH --time=02:00:00\n")
    assert '\nMASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"\n' in text
    srun = text.strip().splitlines()[-1]
    # the node's one task takes all its CPUs: torchrun's ranks and their data loaders are not bound to one core
    assert srun.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=\"$SLURM_CPUS_ON_NODE\" "
                           "--kill-on-bad-exit=1 sh -c "
                           "'export SM_CURRENT_HOST=\"algo-$((SLURM_NODEID + 1))\"; exec \"$@\"' smp2ds-node "
                           "env SM_HP_CHECKPOINT-DIR=/opt/ml/checkpoints torchrun ")
    assert ('torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$RDZV_PORT" '
            '--rdzv-id "$SLURM_JOB_ID" train.py --checkpoint-dir /opt/ml/checkpoints --epochs 2') in srun
    assert "--node-rank" not in srun  # c10d numbers the nodes


def test_slurm_exports_exactly_what_convert_to_torchrun_exports(estimator, capsys):
    flags = ["--output-dir", "/shared/job", "--checkpoint-dir", "/shared/ckpt", "--channel", "train=/shared/data"]
    torchrun = json.loads(convert([estimator, "--to", "torchrun", "--format", "json", *flags], capsys))
    slurm = json.loads(convert([estimator, "--to", "slurm", "--format", "json", *flags], capsys))
    assert slurm["env"] == torchrun["env"]
    assert slurm["env"]["SM_HP_CHECKPOINT-DIR"] == "/shared/ckpt"
    assert json.loads(slurm["env"]["SM_HP_MP_PARAMETERS"])["tensor_parallel_degree"] == 2
    script_at = torchrun["command"].index("train.py")
    assert slurm["command"][slurm["command"].index("train.py"):] == torchrun["command"][script_at:]
    assert (slurm["nodes"], slurm["nproc_per_node"], slurm["world_size"]) == (2, 8, 16)
    assert "mkdir -p /shared/job/model /shared/job/output/data /shared/ckpt" in slurm["script"]
    assert "/opt/ml" not in json.dumps(slurm)


def test_script_runs_with_stand_ins_for_slurm_and_each_node_gets_its_environment(estimator, tmp_path, capsys):
    script = tmp_path / "job.sbatch"
    convert([estimator, "--to", "slurm", "--cpu", "--checkpoint-dir", str(tmp_path / "ckpt"), "-o", str(script)],
            capsys)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # scontrol show hostnames LIST: one name a line; srun: the command once per node, with that node's SLURM_NODEID
    write_stub(bin_dir, "scontrol", 'test "$1 $2 $3" = "show hostnames gpu[07-08]" && printf "gpu07\\ngpu08\\n"\n')
    write_stub(bin_dir, "srun", 'while case "$1" in --*) true;; *) false;; esac; do shift; done\n'
                           'SLURM_NODEID=0 "$@" && SLURM_NODEID=1 "$@"\n')
    report = tmp_path / "report.jsonl"
    write_stub(bin_dir, "torchrun", "import json, os, sys\n"
          f"with open({str(report)!r}, 'a') as out:\n"
          "    out.write(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}) + '\\n')\n", sys.executable)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[07-08]",
           "SLURM_JOB_ID": "4242", "RDZV_PORT": "29555"}
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    nodes = [json.loads(line) for line in report.read_text().splitlines()]
    assert [n["env"]["SM_CURRENT_HOST"] for n in nodes] == ["algo-1", "algo-2"]
    for node in nodes:
        argv, node_env = node["argv"], node["env"]
        assert argv[argv.index("--rdzv-endpoint") + 1] == "gpu07:29555"
        assert argv[argv.index("--rdzv-id") + 1] == "4242"
        assert argv[argv.index("--note") + 1] == "it's $HOME"  # quoted for the shell, arrives verbatim
        assert node_env["SM_HP_CHECKPOINT-DIR"] == str(tmp_path / "ckpt")  # passed by env: no shell can export it
        assert node_env["SM_HP_NOTE"] == "it's $HOME" and node_env["FROM_ESTIMATOR"] == "carried"
        assert node_env["DS_ACCELERATOR"] == "cpu" and node_env["MASTER_ADDR"] == "gpu07"
        assert json.loads(node_env["SM_HP_MP_PARAMETERS"]) == {"ddp": True, "microbatches": 2, "partitions": 1,
                                                               "tensor_parallel_degree": 2}
    assert (tmp_path / "ckpt").is_dir()


def test_ddp_port_moves_the_rendezvous_off_smps_own_port(tmp_path, capsys):
    spec = json.loads(json.dumps(ESTIMATOR))
    spec["distribution"]["smdistributed"]["modelparallel"]["parameters"]["ddp_port"] = 29400
    path = tmp_path / "e.json"
    path.write_text(json.dumps(spec))
    assert 'RDZV_PORT="${RDZV_PORT:-29401}"' in convert([str(path), "--to", "slurm"], capsys)


@pytest.mark.parametrize(("argv", "message"), [
    (["--to", "slurm", "--sbatch", "partition=gpu"], "--sbatch expects one sbatch option"),
    (["--to", "slurm", "--image", "x"], "--image only applies to --to kubernetes, not --to slurm"),
    (["--to", "torchrun", "--cpu"], "--cpu only applies to --to slurm / kubernetes"),
    (["--to", "kubernetes", "--sbatch=--partition=gpu", "--image", "x"], "--sbatch only applies to --to slurm"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(estimator, capsys, argv, message):
    assert main(["convert", estimator, *argv]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# smp2ds launch inside an allocation


def test_hostlists_expand_as_scontrol_show_hostnames_does():
    assert expand_hostlist("gpu[07-09,12],login1") == ["gpu07", "gpu08", "gpu09", "gpu12", "login1"]
    assert expand_hostlist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    assert expand_hostlist("node9") == ["node9"]
    with pytest.raises(SlurmEnvError, match="unbalanced"):
        expand_hostlist("gpu[1-2")


STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_NNODES": "4",
        "SLURM_STEP_NUM_NODES": "4", "SLURM_STEP_NODELIST": "gpu[07-10]", "SLURM_NODEID": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "4"}


@pytest.fixture
def slurm_step(monkeypatch):
    for name in [n for n in os.environ if n.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in STEP.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SMP2DS_NUM_GPUS", "4")


def dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code = main(["launch", *argv, "--launcher", "torchrun", "--dry-run", "--format", "json", "--", "train.py"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_launch_inside_srun_takes_nodes_rank_master_and_processes_from_slurm(slurm_step, capsys):
    spec = dry_run([], capsys)
    command = spec["command"]
    assert command[command.index("--nnodes") + 1] == "4" and command[command.index("--node-rank") + 1] == "2"
    assert command[command.index("--master-addr") + 1] == "gpu07"
    assert command[command.index("--nproc-per-node") + 1] == "4"  # SLURM_GPUS_ON_NODE
    assert spec["env"]["SM_CURRENT_HOST"] == "algo-3" and spec["env"]["MASTER_ADDR"] == "gpu07"
    assert spec["notices"][0].startswith("Slurm job 77: 4 node(s), this is node 2, master gpu07")


def test_flags_win_over_slurm(slurm_step, capsys):
    spec = dry_run(["--nnodes", "4", "--node-rank", "0", "--master-addr", "10.0.0.9", "--nproc-per-node", "2"], capsys)
    command = spec["command"]
    assert command[command.index("--node-rank") + 1] == "0" and command[command.index("--nproc-per-node") + 1] == "2"
    assert command[command.index("--master-addr") + 1] == "10.0.0.9"


def test_tasks_per_node_count_processes_when_no_gpus_are_allocated(slurm_step, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "3")
    command = dry_run([], capsys)["command"]
    assert command[command.index("--nproc-per-node") + 1] == "3"


def test_several_tasks_per_node_are_refused(slurm_step, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "8(x4)")
    assert main(["launch", "--dry-run", "--", "train.py"]) == 2
    assert "srun started 8 tasks on this node" in capsys.readouterr().err


def test_batch_script_of_several_nodes_says_to_use_srun(slurm_step, monkeypatch, capsys):
    monkeypatch.delenv("SLURM_STEP_ID")
    assert main(["launch", "--dry-run", "--", "train.py"]) == 2
    assert "srun --ntasks-per-node=1" in capsys.readouterr().err
    command = dry_run(["--nnodes", "1"], capsys)["command"]  # this node alone, on purpose
    assert command[command.index("--nnodes") + 1] == "1" and command[command.index("--node-rank") + 1] == "0"


def test_outside_slurm_nothing_changes(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert launch_defaults({"PATH": "/bin"}) is None
    assert launch_defaults({**STEP, "SLURM_NODEID": "0"}, nnodes=4)["node_rank"] == 0


def test_the_script_runs_from_source_dir_and_efa_settings_need_asking(tmp_path, capsys):
    spec = {**ESTIMATOR, "source_dir": "gpt2", "distribution": {**ESTIMATOR["distribution"], "mpi": {
        "enabled": True, "processes_per_host": 8,
        "custom_mpi_options": "-x FI_EFA_USE_DEVICE_RDMA=1 -x FI_PROVIDER=efa -x RDMAV_FORK_SAFE=1"}}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    text = convert([str(path), "--to", "slurm"], capsys)
    lines = text.splitlines()
    cd = lines.index('cd "${SLURM_SUBMIT_DIR:-.}"/gpt2  # the estimator\'s source_dir: SageMaker ran the entry point '
                     "from it")
    assert cd < next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert not [line for line in lines if line.startswith(("export FI_", "export RDMAV_"))]
    assert "# left out: FI_EFA_USE_DEVICE_RDMA, FI_PROVIDER, RDMAV_FORK_SAFE (AWS's EFA settings" in text
    kept = convert([str(path), "--to", "slurm", "--efa"], capsys)
    assert "export FI_PROVIDER=efa" in kept and "export FI_EFA_USE_DEVICE_RDMA=1" in kept and "left out" not in kept
