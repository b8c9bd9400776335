"""``gpt2_transformer/train_gpt_simple.py``, written like SMP's GPT-2 example (distributed transformer
through ``model_creation(tensor_parallelism=True, ...)``, ``seq_layers`` partition assignment,
activation checkpointing of ``.attention`` / ``.output``, translate functions for checkpoints), runs
unchanged under ``torchrun`` at tensor_parallel_degree 1 (2 data-parallel ranks), 2, and 2 with
pipeline_parallel_degree 2 (4 ranks: the distributed transformer cut into stages; also with
``--model-type gpt_neo``, a GPT-Neo with a global and a local attention layer), and 2 with
sharded_data_parallel_degree 2 (4 ranks, prescaled_batch, delayed parameter initialization; SMP clips
gradients at 1.0 with sharded data parallelism, and so does the reference), and equals
single-process Hugging Face training from the same starting weights (losses per rank and the
final weights, rtol 1e-4); the checkpoint it writes in Hugging Face's names loads into a plain
Hugging Face model and gives the distributed model's logits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.scripts.torchrun_launch import run_torchrun

SCRIPT = Path(__file__).parent / "gpt2_transformer" / "train_gpt_simple.py"
STEPS, B = 3, 3
EPS = 1e-6
"""Adam's eps: the attention key bias has an exactly-zero gradient (softmax ignores a per-query
constant), so with a tiny eps Adam would turn its rounding noise into full-size steps."""


def _script():
    spec = importlib.util.spec_from_file_location("train_gpt_simple", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(script, init: dict, ranks: int, clip: float | None = None,
               model_type: str = "gpt2") -> tuple[list[list[float]], dict]:
    """The Hugging Face model trained in one process on the union of the ranks' rows (``clip``: SMP's
    gradient clipping, on by default at 1.0 with sharded data parallelism)."""
    model = script.MODELS[model_type][0](script.model_config(model_type))
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=EPS)
    ids, mask = script.batches(STEPS, B * ranks)
    losses = []
    for step in range(STEPS):
        per_rank = []
        for r in range(ranks):
            x, m = ids[step, r * B:(r + 1) * B], mask[step, r * B:(r + 1) * B]
            per_rank.append(model(input_ids=x, attention_mask=m, labels=x.masked_fill(m == 0, -100)).loss)
        losses.append([v.item() for v in per_rank])
        torch.stack(per_rank).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, model.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,sdp,model_type", [(1, 1, 1, "gpt2"), (2, 1, 1, "gpt2"), (2, 2, 1, "gpt2"),
                                                   (2, 1, 2, "gpt2"), (2, 2, 1, "gpt_neo")])
def test_smp_gpt2_transformer_script_runs_unchanged_and_matches_hugging_face(tp, pp, sdp, model_type, tmp_path):
    script = _script()
    torch.manual_seed(31)
    init = script.MODELS[model_type][0](script.model_config(model_type)).state_dict()
    torch.save(init, tmp_path / "init.pt")
    args = ["--tensor-parallel-degree", str(tp), "--pipeline-parallel-degree", str(pp), "--steps", str(STEPS),
            "--train-batch-size", str(B), "--init-from", str(tmp_path / "init.pt"), "--adam-eps", str(EPS),
            "--checkpoint-dir", str(tmp_path), "--model-type", model_type]
    if sdp > 1:  # SMP 1.15+: tensor parallelism with sharded data parallelism needs prescaled_batch
        args += ["--sharded-data-parallel-degree", str(sdp), "--prescaled-batch", "1", "--delayed-param", "1"]
    reports = run_torchrun(SCRIPT, 2 * pp * sdp, args, timeout_s=400)
    losses, weights = _reference(script, init, 2, clip=1.0 if sdp > 1 else None, model_type=model_type)
    # 2 data ranks: per stage, or (prescaled_batch) per tensor-parallel group
    assert sorted(rep["dp_rank"] for rep in reports) == sorted([0, 1] * pp * sdp)
    for rep in reports:
        assert rep["class"] == "DistributedTransformerLMHead" and rep["tp"][1] == tp and rep["pp"][1] == pp
        np.testing.assert_allclose(rep["losses"], [s[rep["dp_rank"]] for s in losses], rtol=1e-4, atol=1e-6)
        assert set(rep["weights"]) == set(weights)
        for key, want in weights.items():
            np.testing.assert_allclose(rep["weights"][key], want.flatten().numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=key)
        assert rep["checkpoint_logits_max_diff"] < 1e-5
