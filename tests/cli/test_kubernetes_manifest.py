"""``smp2ds convert --to kubernetes``: a Kubeflow ``PyTorchJob`` the training-operator accepts and that starts the job.

Every manifest is validated against the operator's published CRD schema (``schemas/vendor/kubeflow-training-operator``,
v1.9 line), made strict here: an object node that lists properties accepts no other key, as
``kubectl apply --validate=strict`` would refuse unknown fields. The pods' command runs here as a pod would run it
(Kubernetes' ``$$`` unescaped, the operator's ``PET_*`` variables set, a stand-in ``torchrun``), and torchrun's own
parser reads its flags from those ``PET_*`` variables.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from smp2ds.cli import main
from tests.cli.convert_helpers import convert, write_stub

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_PATH = ROOT / "schemas" / "vendor" / "kubeflow-training-operator" / "pytorchjob-v1.openapi.json"
ESTIMATOR = {
    "entry_point": "train.py",
    "instance_type": "ml.p4d.24xlarge",
    "instance_count": 3,
    "hyperparameters": {"checkpoint-dir": "/opt/ml/checkpoints", "price": "$(HOME) $5", "epochs": 2},
    "environment": {"FROM_ESTIMATOR": "carried"},
    "distribution": {"mpi": {"enabled": True, "processes_per_host": 8},
                     "smdistributed": {"modelparallel": {"enabled": True, "parameters": {
                         "ddp": True, "microbatches": 2, "tensor_parallel_degree": 4}}}},
}


def strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object node that lists properties."""
    if isinstance(schema, dict):
        out = {key: strict(value) for key, value in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


VALIDATOR = jsonschema.Draft7Validator(strict(json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))))


def validate(manifest: dict[str, Any]) -> None:
    errors = sorted(VALIDATOR.iter_errors(manifest), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def estimator_file(tmp_path: Path, **changes: Any) -> str:
    spec = {**copy.deepcopy(ESTIMATOR), **changes}
    path = tmp_path / "GPT Job_v2.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return str(path)


def unescape(value: str) -> str:
    """What Kubernetes makes of a command word or env value without ``$(NAME)`` references: ``$$`` -> ``$``."""
    return value.replace("$$", "$")


def test_manifest_is_a_valid_pytorchjob_with_the_plans_replicas_and_gpus(tmp_path, capsys):
    yaml = pytest.importorskip("yaml")
    out = tmp_path / "job.yaml"
    convert([estimator_file(tmp_path), "--to", "kubernetes", "--image", "registry.example/train:1", "-o", str(out)],
            capsys)
    manifest = yaml.safe_load(out.read_text(encoding="utf-8"))
    validate(manifest)
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "PyTorchJob"
    assert manifest["metadata"]["name"] == "smp2ds-gpt-job-v2"
    spec = manifest["spec"]
    assert spec["nprocPerNode"] == "8"
    replicas = spec["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)  # 3 instances
    for replica in replicas.values():
        container = replica["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch" and container["image"] == "registry.example/train:1"
        assert container["resources"] == {"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}
        assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
        # a memory-backed /dev/shm: the runtime's 64 MB default crashes NCCL and DataLoader workers
        assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        assert replica["template"]["spec"]["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    json_text = convert([estimator_file(tmp_path), "--to", "kubernetes", "--image", "registry.example/train:1",
                         "--format", "json"], capsys)
    assert json.loads(json_text) == manifest  # the same manifest, as JSON


def test_pods_get_exactly_the_environment_of_convert_to_torchrun(tmp_path, capsys):
    path = estimator_file(tmp_path)
    flags = ["--output-dir", "/mnt/job", "--checkpoint-dir", "/mnt/ckpt"]
    torchrun = json.loads(convert([path, "--to", "torchrun", "--format", "json", *flags], capsys))
    manifest = json.loads(convert([path, "--to", "kubernetes", "--image", "i", "--format", "json", *flags], capsys))
    validate(manifest)
    container = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    env = {item["name"]: unescape(item["value"]) for item in container["env"]}
    assert env == torchrun["env"]
    assert env["SM_HP_PRICE"] == "$(HOME) $5" and env["SM_HP_CHECKPOINT-DIR"] == "/mnt/ckpt"
    command = [unescape(word) for word in container["command"]]
    script_at = torchrun["command"].index("train.py")
    assert command[command.index("torchrun") + 1:] == torchrun["command"][script_at:]


def test_each_pod_runs_torchrun_with_its_node_name_and_every_variable(tmp_path, capsys):
    manifest = json.loads(convert([estimator_file(tmp_path), "--to", "kubernetes", "--image", "i", "--cpu",
                                   "--format", "json"], capsys))
    validate(manifest)
    worker = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert worker["resources"] == {"requests": {"cpu": 8}, "limits": {"cpu": 8}}  # --cpu: a core per rank, no GPU
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    report = tmp_path / "report.json"
    write_stub(bin_dir, "torchrun", "import json, os, sys\n"
          f"open({str(report)!r}, 'w').write(json.dumps({{'argv': sys.argv[1:], 'env': dict(os.environ)}}))\n",
          sys.executable)
    pod_env = {item["name"]: unescape(item["value"]) for item in worker["env"]}
    # what the operator adds to the second worker's pod
    operator = {"PET_NODE_RANK": "2", "PET_NNODES": "3", "PET_NPROC_PER_NODE": "8", "PET_MASTER_ADDR": "job-master-0",
                "PET_MASTER_PORT": "23456", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    command = [unescape(word) for word in worker["command"]]
    proc = subprocess.run(command, env={**pod_env, **operator}, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(report.read_text())
    assert seen["env"]["SM_CURRENT_HOST"] == "algo-3"
    assert seen["env"]["SM_HP_CHECKPOINT-DIR"] == "/opt/ml/checkpoints"  # survives sh, which drops such names
    assert seen["env"]["DS_ACCELERATOR"] == "cpu" and seen["env"]["SM_HP_PRICE"] == "$(HOME) $5"
    assert seen["argv"][:1] == ["train.py"] and seen["argv"][seen["argv"].index("--price") + 1] == "$(HOME) $5"


def test_torchrun_reads_its_flags_from_the_operators_variables(monkeypatch):
    run = pytest.importorskip("torch.distributed.run")
    for name, value in {"PET_NNODES": "3", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2",
                        "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456"}.items():
        monkeypatch.setenv(name, value)
    args = run.parse_args(["train.py", "--epochs", "2"])
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("3", "8", 2)
    assert (args.master_addr, args.master_port, args.training_script) == ("job-master-0", 23456, "train.py")


def test_one_node_has_a_master_only_and_runs_torchrun_directly(tmp_path, capsys):
    out = tmp_path / "m.json"  # -o FILE.json: JSON, whatever is installed
    convert([estimator_file(tmp_path, instance_count=1), "--to", "kubernetes", "--image", "i", "--job-name", "mlp",
             "--namespace", "team-a", "-o", str(out)], capsys)
    manifest = json.loads(out.read_text(encoding="utf-8"))
    validate(manifest)
    assert manifest["metadata"] == {"name": "mlp", "namespace": "team-a",
                                    "labels": {"app.kubernetes.io/created-by": "smp2ds"}}
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Master"]
    assert replicas["Master"]["template"]["spec"]["containers"][0]["command"][:2] == ["torchrun", "train.py"]


def test_without_pyyaml_the_manifest_is_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml now fails
    validate(json.loads(convert([estimator_file(tmp_path), "--to", "kubernetes", "--image", "i"], capsys)))


def test_smps_ddp_port_keeps_the_operators_port_free(tmp_path, capsys):
    path = estimator_file(tmp_path)
    spec = json.loads(Path(path).read_text())
    spec["distribution"]["smdistributed"]["modelparallel"]["parameters"]["ddp_port"] = 23456
    Path(path).write_text(json.dumps(spec))
    manifest = json.loads(convert([path, "--to", "kubernetes", "--image", "i", "--format", "json"], capsys))
    container = manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == 23457


def test_the_strict_schema_catches_a_misspelled_field_or_a_wrong_type():
    manifest = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "x"},
                "spec": {"nprocPerNode": 8, "pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {
                    "containers": [{"name": "pytorch", "image": "i", "enviroment": []}]}}}}}}
    messages = [e.message for e in VALIDATOR.iter_errors(manifest)]
    assert any("'enviroment' was unexpected" in m for m in messages)
    assert any("8 is not of type 'string'" in m for m in messages)


@pytest.mark.parametrize(("argv", "message"), [
    (["--to", "kubernetes"], "--to kubernetes needs --image IMAGE"),
    (["--to", "kubernetes", "--image", "i", "--job-name", "My_Job"], "--job-name 'My_Job' is not a Kubernetes name"),
    (["--to", "torchrun", "--image", "i"], "--image only applies to --to kubernetes, not --to torchrun"),
    (["--to", "slurm", "--namespace", "a"], "--namespace only applies to --to kubernetes"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(tmp_path, capsys, argv, message):
    assert main(["convert", estimator_file(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


EFA_OPTIONS = "-x FI_EFA_USE_DEVICE_RDMA=1 -x FI_PROVIDER=efa -x RDMAV_FORK_SAFE=1"


def test_efa_settings_are_left_out_unless_asked_and_then_the_pods_ask_for_efa_devices(tmp_path, capsys):
    mpi = {"enabled": True, "processes_per_host": 8, "custom_mpi_options": EFA_OPTIONS}
    path = estimator_file(tmp_path, distribution={**ESTIMATOR["distribution"], "mpi": mpi})
    plain = json.loads(convert([path, "--to", "kubernetes", "--image", "i", "--format", "json"], capsys))
    validate(plain)
    container = plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert not {e["name"] for e in container["env"]} & {"FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "RDMAV_FORK_SAFE"}
    assert plain["metadata"]["annotations"]["smp2ds/left-out-env"].startswith(
        "FI_EFA_USE_DEVICE_RDMA,FI_PROVIDER,RDMAV_FORK_SAFE (AWS EFA settings; convert with --efa")
    assert "vpc.amazonaws.com/efa" not in container["resources"]["limits"]
    efa = json.loads(convert([path, "--to", "kubernetes", "--image", "i", "--format", "json", "--efa"], capsys))
    validate(efa)
    container = efa["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["RDMAV_FORK_SAFE"]) == ("efa", "1", "1")
    assert container["resources"]["requests"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 4}  # p4d: 4
    assert "annotations" not in efa["metadata"]
