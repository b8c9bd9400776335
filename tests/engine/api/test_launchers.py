"""The example SMP script runs unchanged under the deepspeed launcher, torchrun and mpirun.

Same SM_HP_MP_PARAMETERS (2 ranks, micro-batches 2, optimizer-state sharding) under each; the
final weights must be bit-identical across launchers and equal a plain-PyTorch reference
trained on the union of the ranks' data.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests._dist import BASE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "examples", "train_smp_mlp.py")
SMP = {"ddp": True, "microbatches": 2, "shard_optimizer_state": True, "partitions": 1}
STEPS, BATCH, LR = 6, 8, 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(launcher: str, dump: str) -> list[str]:
    args = [SCRIPT, "--steps", str(STEPS), "--batch-size", str(BATCH), "--lr", str(LR), "--dump-weights", dump]
    if launcher == "deepspeed":
        return [shutil.which("deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port()), *args]
    if launcher == "torchrun":
        return [shutil.which("torchrun"), "--nproc-per-node", "2", "--master-port", str(_free_port()), *args]
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "SM_HP_MP_PARAMETERS",
            "-x", "DS_ACCELERATOR", "-x", "OMP_NUM_THREADS", "-x", "PATH", "-x", "PYTHONPATH", sys.executable, *args]


def _reference() -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("train_smp_mlp", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = example.dataset()
    for step in range(STEPS):
        start = (step * BATCH * 2) % x.shape[0]
        opt.zero_grad()
        F.mse_loss(model(x[start:start + 2 * BATCH]), y[start:start + 2 * BATCH]).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.slow
def test_example_script_gives_identical_results_under_three_launchers(tmp_path):
    missing = [t for t in ("deepspeed", "torchrun", "mpirun") if shutil.which(t) is None]
    assert not missing, f"launchers not installed: {missing}"
    env = dict(os.environ, **BASE_ENV, SM_HP_MP_PARAMETERS=json.dumps(SMP),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    digests, reference = {}, _reference()
    for launcher in ("deepspeed", "torchrun", "mpirun"):
        dump = str(tmp_path / f"{launcher}.pt")
        proc = subprocess.run(_command(launcher, dump), env=env, capture_output=True, text=True, timeout=400, check=False,
                              cwd=str(tmp_path))
        assert proc.returncode == 0, f"{launcher} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        found = re.findall(r"final weights sha256 (\w+)", proc.stdout)
        assert len(found) == 1, proc.stdout  # printed once, by rank 0
        digests[launcher] = found[0]
        assert len(re.findall(r"^step \d+ loss", proc.stdout, re.MULTILINE)) == STEPS
        assert '"stage": 1' in proc.stdout  # the plan: ZeRO-1 for shard_optimizer_state
        weights = torch.load(dump)
        for k, v in reference.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-5, atol=1e-6, msg=f"{launcher}: {k}")
    assert len(set(digests.values())) == 1, digests
