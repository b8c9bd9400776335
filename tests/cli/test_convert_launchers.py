"""``convert --to torchrun|deepspeed-launcher|mpirun|accelerate``: the printed launches really run.

The single-node scripts are run as printed (only SageMaker's host name ``algo-1`` is mapped to
this machine, as the script's comment tells users to) and every rank reports the SageMaker
environment it got; the multi-node deepspeed script's ``.deepspeed_env`` is read back through
DeepSpeed's own export quoting and a real shell. ``--to accelerate`` is run by
``accelerate launch --config_file`` on 2 CPU ranks and the run reports the DeepSpeed settings
it used.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from smp2ds.cli import main
from tests.cli.convert_helpers import convert

ROOT = Path(__file__).resolve().parents[2]
GPT2_30B = ROOT / "examples" / "configs" / "gpt2_30b_sdp_002.json"
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "SMP2DS_NUM_GPUS": "0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def estimator(tmp_path: Path, script: str, **params: object) -> str:
    """A one-node, two-process estimator spec whose entry point is ``script``."""
    spec = {
        "entry_point": script,
        "instance_type": "ml.g5.12xlarge",
        "instance_count": 1,
        # a hyphenated name: SM_HP_CHECKPOINT-DIR, which no shell can export
        "hyperparameters": {"out": str(tmp_path), "checkpoint-dir": str(tmp_path / "ckpt")},
        "environment": {"FROM_ESTIMATOR": "carried"},  # the estimator's own variables
        "distribution": {
            "mpi": {"enabled": True, "processes_per_host": 2},
            "smdistributed": {
                "modelparallel": {
                    "enabled": True,
                    "parameters": {"ddp": True, "microbatches": 2, "ddp_port": free_port(), **params},
                }
            },
        },
    }
    path = tmp_path / "estimator.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------
# launch scripts: what they say


def test_torchrun_multinode_script_names_nodes_processes_and_env(capsys):
    text = convert([str(GPT2_30B), "--to", "torchrun"], capsys)
    command = text.strip().splitlines()[-1]
    assert command.startswith(
        'torchrun --nnodes 32 --nproc-per-node 8 --node-rank "${NODE_RANK}" --master-addr "${MASTER_ADDR:-algo-1}" '
        "--master-port 29760 train_gpt_simple.py --activation_checkpointing 1"
    )  # estimator: 32 x ml.p4d.24xlarge, 8 processes per host, its entry_point
    assert "# run on every node with NODE_RANK set to its index (0 on algo-1, the master)" in text
    # the EFA settings of custom_mpi_options reach the ranks under torchrun too
    assert "export FI_PROVIDER=efa" in text and "export FI_EFA_USE_DEVICE_RDMA=1" in text
    assert 'export SM_CURRENT_HOST="algo-$((NODE_RANK + 1))"' in text
    assert "export SM_HP_MP_PARAMETERS='{\"activation_loading_horizon\":4," in text


def test_json_format_is_the_same_launch(capsys):
    spec = json.loads(convert([str(GPT2_30B), "--to", "mpirun", "--format", "json"], capsys))
    assert (spec["launcher"], spec["nodes"], spec["nproc_per_node"], spec["world_size"]) == ("mpirun", 32, 8, 256)
    assert spec["command"][:6] == ["mpirun", "--host", ",".join(f"algo-{i}:8" for i in range(1, 33)), "-np", "256",
                                   "--allow-run-as-root"]
    assert "-x" in spec["command"] and "SM_HP_MP_PARAMETERS" in spec["command"]
    assert json.loads(spec["env"]["SM_HP_MP_PARAMETERS"])["sharded_data_parallel_degree"] == 128


def test_deepspeed_multinode_env_file_survives_deepspeeds_quoting(capsys, tmp_path):
    """DeepSpeed reads .deepspeed_env, double-quotes values and runs `export K=V;` on each node."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    spec = json.loads(convert([str(GPT2_30B), "--to", "deepspeed-launcher", "--format", "json"], capsys))
    assert spec["command"][:7] == ["deepspeed", "--hostfile", "hostfile", "--num_nodes", "32", "--master_addr",
                                   "algo-1"]
    assert spec["files"]["hostfile"].splitlines()[31] == "algo-32 slots=8"
    runner = PDSHRunner(
        argparse_namespace(user_script="train.py", user_args=[], launcher_args="", master_addr="algo-1"), ""
    )
    for line in spec["files"][".deepspeed_env"].splitlines(keepends=True):
        key, value = line.split("=", maxsplit=1)  # as deepspeed.launcher.runner reads the file
        runner.add_export(key, value)
    exports = "".join(f"export {key}={value}; " for key, value in runner.exports.items())
    probe = "import json, os, sys; print(json.dumps({k: os.environ[k] for k in sys.argv[1:]}))"
    shell = subprocess.run(
        ["bash", "-c", exports + f'exec {sys.executable} -c "$0" "$@"', probe, *spec["env"]],
        capture_output=True, text=True, check=True, env={"PATH": os.environ["PATH"]},
    )
    assert json.loads(shell.stdout) == spec["env"]  # every value, JSON quotes included, arrives intact

    text = convert([str(GPT2_30B), "--to", "deepspeed-launcher"], capsys)
    assert "cat > hostfile <<'SMP2DS_EOF'" in text and "cat > .deepspeed_env <<'SMP2DS_EOF'" in text


def argparse_namespace(**values: object) -> object:
    import argparse

    return argparse.Namespace(**values)


def test_accelerate_needs_an_output_file(capsys):
    assert main(["convert", str(GPT2_30B), "--to", "accelerate"]) == 2
    assert "--to accelerate writes two files (OUT and the DeepSpeed JSON it names); give -o OUT.yaml" in (
        capsys.readouterr().err
    )


def test_accelerate_refuses_to_replace_the_deepspeed_json(tmp_path, capsys):
    (tmp_path / "run.deepspeed.json").write_text("{}")
    assert main(["convert", str(GPT2_30B), "--to", "accelerate", "-o", str(tmp_path / "run.yaml")]) == 2
    assert f"{tmp_path / 'run.deepspeed.json'} exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert not (tmp_path / "run.yaml").exists()


# ---------------------------------------------------------------------------------------------
# launch scripts: they run

RANK_SCRIPT = """
import argparse, json, os
parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--checkpoint-dir")
args = parser.parse_args()
rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
seen = {k: os.environ.get(k) for k in ("SM_HP_MP_PARAMETERS", "SM_HOSTS", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE",
                                       "SM_HP_CHECKPOINT-DIR", "FROM_ESTIMATOR")}
seen["checkpoint_dir_arg"] = args.checkpoint_dir
with open(os.path.join(args.out, f"rank-{rank}.json"), "w") as handle:
    json.dump(seen, handle)
"""


@pytest.mark.slow
@pytest.mark.parametrize("target", ["torchrun", "deepspeed-launcher", "mpirun"])
def test_printed_single_node_launch_runs_two_ranks(target, tmp_path, capsys):
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT, encoding="utf-8")
    text = convert([estimator(tmp_path, str(script)), "--to", target], capsys)
    assert "NODE_RANK" not in text  # one node: nothing for the user to set
    # the user's one edit the script asks for: SageMaker's host name -> this machine
    runnable = re.sub(r"\balgo-1\b(?!\")", "localhost", text).replace("mpirun ", "mpirun --oversubscribe ", 1)
    proc = subprocess.run(
        ["sh", "-c", runnable], capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert json.loads(seen["SM_HP_MP_PARAMETERS"])["microbatches"] == 2
        assert json.loads(seen["SM_HOSTS"]) == ["algo-1"]
        assert (seen["WORLD_SIZE"] or seen["OMPI_COMM_WORLD_SIZE"]) == "2"
        assert seen["SM_HP_CHECKPOINT-DIR"] == seen["checkpoint_dir_arg"] == str(tmp_path / "ckpt")
        assert seen["FROM_ESTIMATOR"] == "carried"


# ---------------------------------------------------------------------------------------------
# accelerate launch --config_file

ACCELERATE_SCRIPT = """
import json, sys
import torch
from accelerate import Accelerator

accelerator = Accelerator()
plugin = accelerator.state.deepspeed_plugin
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
engine, optimizer = accelerator.prepare(model, optimizer)
report = {
    "rank": torch.distributed.get_rank(),
    "world": torch.distributed.get_world_size(),
    "distributed_type": str(accelerator.state.distributed_type),
    "plugin_zero_stage": plugin.zero_stage,
    "plugin_accumulation": plugin.deepspeed_config["gradient_accumulation_steps"],
    "engine": type(engine).__name__,
    "engine_zero_stage": engine.zero_optimization_stage(),
    "engine_accumulation": engine.gradient_accumulation_steps(),
    "engine_micro_batch": engine.train_micro_batch_size_per_gpu(),
    "engine_dp_world": engine.dp_world_size,
    "engine_clipping": engine.gradient_clipping(),
}
with open(f"{sys.argv[1]}/accelerate-{report['rank']}.json", "w") as handle:
    json.dump(report, handle)
"""


@pytest.mark.slow
def test_accelerate_launch_runs_the_converted_deepspeed_config(tmp_path, capsys):
    script = tmp_path / "accelerate_script.py"
    script.write_text(ACCELERATE_SCRIPT, encoding="utf-8")
    source = estimator(tmp_path, "train.py", shard_optimizer_state=True)
    out = tmp_path / "run.yaml"
    convert([source, "--batch-size", "4", "--to", "accelerate", "-o", str(out)], capsys)
    ds = json.loads((tmp_path / "run.deepspeed.json").read_text())
    assert (ds["zero_optimization"]["stage"], ds["gradient_accumulation_steps"]) == (1, 2)  # what SMP asked
    assert f'deepspeed_config_file: "{tmp_path / "run.deepspeed.json"}"' in out.read_text()

    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(out), str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"accelerate-{rank}.json").read_text())
        assert seen["world"] == 2 and seen["distributed_type"] == "DistributedType.DEEPSPEED"
        assert seen["engine"] == "DeepSpeedEngine"
        assert (seen["plugin_zero_stage"], seen["plugin_accumulation"]) == (1, 2)
        assert (seen["engine_zero_stage"], seen["engine_accumulation"], seen["engine_micro_batch"]) == (
            ds["zero_optimization"]["stage"],
            ds["gradient_accumulation_steps"],
            ds["train_micro_batch_size_per_gpu"],
        )
        assert seen["engine_dp_world"] == 2 and seen["engine_clipping"] == ds["gradient_clipping"]


# ---------------------------------------------------------------------------------------------
# start-up: what validate / convert / explain import


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", str(GPT2_30B)],
        ["convert", str(GPT2_30B)],
        ["convert", str(GPT2_30B), "--to", "torchrun"],
        ["explain", str(GPT2_30B), "--params", "30e9"],
        ["schema", "--print", "estimator"],
    ],
    ids=lambda argv: " ".join(a for a in argv if not a.startswith("/")),
)
def test_valid_input_imports_neither_frameworks_nor_jsonschema(argv):
    """Valid input takes the fast schema check: no torch/deepspeed/transformers, no jsonschema."""
    probe = (
        "import sys\n"
        "from smp2ds.cli import main\n"
        f"code = main({argv!r})\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'deepspeed', 'transformers', "
        "'accelerate', 'jsonschema', 'referencing', 'yaml', 'numpy'})\n"
        "print('HEAVY', code, heavy, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert "HEAVY 0 []" in proc.stderr, proc.stderr[-2000:]


def test_invalid_input_still_gets_jsonschemas_detailed_issues(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"microbatches": True, "partitions": 2}), encoding="utf-8")
    assert main(["validate", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "/microbatches: must be an integer, not a boolean" in out
