"""SMP's helper modules that public scripts import (``optimizers``, ``state_mod``, ``utils``), used by an
unchanged script (``helper_modules/train_with_smp_helpers.py``) under ``torchrun``: FusedLAMB over data
parallelism, a pipeline and tensor parallelism (its global gradient norm is the whole model's), FusedAdam and
FusedNovoGrad, each equal to the same script run as one plain process; ``rmsg`` prefixes the rank, ``state``
is the running state, ``get_distribution_axis`` names the parameters tensor parallelism split, and
``model.module.module`` is the model behind SMP's data-parallel wrapper (an instance of torch's
``DistributedDataParallel``, as the examples' unwrapping loops expect). The update rules
themselves are checked against apex's formulas, step by step, in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests._dist import BASE_ENV
from tests.scripts.torchrun_launch import run_torchrun

SCRIPT = Path(__file__).parent / "helper_modules" / "train_with_smp_helpers.py"


def _reference(optimizer: str, data_ranks: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SM_")}
        env.update(BASE_ENV, SMP2DS_SCRIPT_OUT=out, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.run([sys.executable, str(SCRIPT), "--reference", "1", "--optimizer", optimizer,
                               "--data-ranks", str(data_ranks)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads((Path(out) / "reference.json").read_text())


LAYOUTS = [
    ("lamb", {"ddp": True}, 2),
    ("lamb", {"ddp": True, "partitions": 2, "microbatches": 2}, 2),
    ("lamb", {"ddp": True, "tensor_parallel_degree": 2}, 2),
    ("adam", {"ddp": True, "tensor_parallel_degree": 2}, 2),
    ("novograd", {"ddp": True, "partitions": 2, "microbatches": 2}, 2),
    ("novograd", {"ddp": True, "tensor_parallel_degree": 2}, 2),
]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,parameters,world", LAYOUTS)
def test_script_using_smp_helper_modules_matches_one_process(optimizer, parameters, world):
    reports = run_torchrun(SCRIPT, world, ["--optimizer", optimizer], smp_parameters=parameters, timeout_s=300)
    data_ranks = reports[0]["dp_size"]
    ref = _reference(optimizer, data_ranks)
    for rank, rep in enumerate(reports):
        assert rep["walked_is_model"] and rep["wrapper_is_ddp"]
        assert rep["state_model_is_model"] and rep["microbatches"] == parameters.get("microbatches", 1)
        assert rep["log"][0].startswith(f"[{rank}] step 0 loss")
        if parameters.get("tensor_parallel_degree", 1) > 1:  # nn.Linear -> DistributedLinear, split on dim 0
            assert rep["split"] == ["down.bias", "down.weight", "up.bias", "up.weight"], rep["split"]
        else:
            assert rep["split"] == []
        np.testing.assert_allclose(rep["losses"], [s[rep["dp_rank"]] for s in ref["losses"]], rtol=1e-5, atol=1e-6)
        for key, want in ref["weights"].items():
            np.testing.assert_allclose(rep["weights"][key], want, rtol=1e-5, atol=1e-6, err_msg=key)


def test_lamb_and_novograd_follow_apex_formulas_step_by_step():
    """Two steps of each on two tensors, against apex's update written out with numpy."""
    from smp2ds.engine.api.optimizers import FusedLAMB, FusedNovoGrad

    g1 = [np.array([0.3, -0.4, 1.2]), np.array([[2.0, -1.0], [0.5, 0.25]])]
    g2 = [np.array([-0.1, 0.2, 0.05]), np.array([[0.3, 0.1], [-0.2, 0.4]])]
    w0 = [np.array([1.0, 2.0, -1.0]), np.array([[0.5, -0.5], [1.5, 0.2]])]
    lr, b1, b2, wd = 0.1, 0.9, 0.999, 0.01

    def lamb_ref(eps=1e-6, max_norm=1.0):
        w, m, v = [x.copy() for x in w0], [np.zeros_like(x) for x in w0], [np.zeros_like(x) for x in w0]
        for t, grads in enumerate((g1, g2), start=1):
            norm = np.sqrt(sum((g ** 2).sum() for g in grads))
            clip = norm / max_norm if norm > max_norm else 1.0
            for i, g in enumerate(grads):
                g = g / clip
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                u = (m[i] / (1 - b1 ** t)) / (np.sqrt(v[i] / (1 - b2 ** t)) + eps) + wd * w[i]
                ratio = np.linalg.norm(w[i]) / np.linalg.norm(u)
                w[i] = w[i] - lr * ratio * u
        return w

    def novograd_ref(eps=1e-8):
        w, m = [x.copy() for x in w0], [np.zeros_like(x) for x in w0]
        v = [np.linalg.norm(g) for g in g1]
        for t, grads in enumerate((g1, g2), start=1):
            for i, g in enumerate(grads):
                v[i] = np.sqrt(b2 * v[i] ** 2 + (1 - b2) * (g ** 2).sum())
                m[i] = b1 * m[i] + (1 - b1) * g / (v[i] / np.sqrt(1 - b2 ** t) + eps)
                w[i] = w[i] - lr * (m[i] / (1 - b1 ** t) + wd * w[i])
        return w

    for cls, ref in ((FusedLAMB, lamb_ref()), (FusedNovoGrad, novograd_ref())):
        params = [torch.nn.Parameter(torch.tensor(x, dtype=torch.float64)) for x in w0]
        opt = cls(params, lr=lr, weight_decay=wd)
        for grads in (g1, g2):
            for p, g in zip(params, grads):
                p.grad = torch.tensor(g, dtype=torch.float64)
            opt.step()
        for p, want in zip(params, ref):
            np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-6, err_msg=cls.__name__)


def _lamb_under_zero(config: dict) -> str | None:
    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch.optimizers import FusedLAMB

    smp.init(config)
    model = smp.DistributedModel(torch.nn.Linear(4, 4))
    try:
        smp.DistributedOptimizer(FusedLAMB(model.parameters()))
    except smp.exceptions.SMPUnsupportedError as err:
        return str(err)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("config", [{"ddp": True, "shard_optimizer_state": True}, {"ddp": True, "bf16": True}])
def test_lamb_is_refused_where_deepspeed_hands_it_flat_partitions(config):
    from tests._dist import run_ranks

    for message in run_ranks(_lamb_under_zero, 2, config):
        assert message is not None and "FusedLAMB takes each parameter's norm" in message, message
