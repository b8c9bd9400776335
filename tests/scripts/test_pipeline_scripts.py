"""Pipelines through unchanged SMP-style scripts (torchrun, CPU, gloo) against plain PyTorch.

`pipeline/mnist_grouped.py` is written as SMP's MNIST example: a custom ``GroupedNet`` (no
``nn.Sequential``, no Hugging Face: the torch.fx traced path), data on ``pp_rank 0`` only and
empty dummies on the other stages (the step runs with the first stage's inputs), SGD or Adam,
``optimizer.clip_master_grads`` with a limit below the gradient norm (so it clips), then an
evaluation step. Each launch is compared with a single-process reference on the same seed and
data: per-micro-batch losses on every rank, the norms before clipping, the evaluation loss and
the final weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.scripts.pipeline_reference import load_script, micro_batched_reference
from tests.scripts.torchrun_launch import run_torchrun

SCRIPT = Path(__file__).parent / "pipeline" / "mnist_grouped.py"
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _script_module():
    return load_script(SCRIPT)


def reference(steps: int, dp: int, micro: int, optimizer: str, clip: float, model: str = "grouped") -> dict:
    """Plain PyTorch on one process: SMP's averaging over micro-batches and replicas, torch's clipping."""
    script = _script_module()
    torch.manual_seed(0)
    model = script.MODELS[model]()
    opt = script.make_optimizer(optimizer, model.parameters())
    losses, norms = [], []  # losses[step][dp_rank] = per-micro-batch losses
    for step in range(steps):
        data, target = script.global_batch(step, dp)
        per_rank = []
        for r in range(dp):
            rows = slice(r * script.PER_RANK, (r + 1) * script.PER_RANK)
            mine = []
            for x, y in zip(data[rows].chunk(micro), target[rows].chunk(micro)):
                loss = F.nll_loss(model(x), y)
                (loss / (micro * dp)).backward()
                mine.append(float(loss.detach()))
            per_rank.append(mine)
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(per_rank)
    model.eval()
    data, target = script.global_batch(99, dp)
    with torch.no_grad():
        evals = [float(F.nll_loss(model(data[r * script.PER_RANK:(r + 1) * script.PER_RANK]),
                                  target[r * script.PER_RANK:(r + 1) * script.PER_RANK], reduction="sum"))
                 for r in range(dp)]
    return {"losses": losses, "norms": norms, "eval": evals, "state": model.state_dict()}


def check_against_reference(results: list[dict], *, steps: int, dp: int, micro: int, optimizer: str,
                            clip: float, model: str = "grouped") -> dict:
    ref = reference(steps, dp, micro, optimizer, clip, model)
    for res in results:
        label = f"rank {res['rank']} (pp {res['pp_rank']}, dp {res['dp_rank']})"
        expected = [ref["losses"][s][res["dp_rank"]] for s in range(steps)]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(expected), **TOL, msg=label)
        torch.testing.assert_close(torch.tensor(res["eval_loss"]), torch.tensor(ref["eval"][res["dp_rank"]]), **TOL)
        if clip:
            torch.testing.assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), **TOL, msg=label)
        assert set(res["state"]) == set(ref["state"])
        for key, value in ref["state"].items():
            torch.testing.assert_close(torch.tensor(res["state"][key]), value, **TOL, msg=f"{label} {key}")
    if clip:  # the limit was below the norm in every step, so clipping changed the update
        assert all(n > clip for n in ref["norms"]), ref["norms"]
    return ref


@pytest.mark.slow
def test_skip_net_pp2_data_on_first_stage_only_manual_contexts_adam_gpipe_matches_reference():
    """pp 2 on 2 ranks, 4 micro-batches, GPipe (``pipeline: simple``), Adam, and SMP's MNIST placement:
    ``with smp.partition(i)`` around each child with ``auto_partition: false``. ``net2`` also takes the
    raw image, so the input data crosses the stage boundary next to the activation."""
    steps, micro = 3, 4
    results = run_torchrun(SCRIPT, 2, ["--steps", str(steps), "--optimizer", "adam", "--partition", "contexts",
                                       "--model", "skip"],
                           smp_parameters={"partitions": 2, "microbatches": micro, "pipeline": "simple",
                                           "auto_partition": False, "default_partition": 0, "ddp": True})
    check_against_reference(results, steps=steps, dp=1, micro=micro, optimizer="adam", clip=0.0, model="skip")
    assert [r["pp_rank"] for r in results] == [0, 1]
    assert results[0]["local_modules"] == ["net1.conv1", "net1.conv2"]
    assert results[1]["local_modules"] == ["net2.fc1", "net2.fc2", "net2.skip"]


@pytest.mark.slow
def test_grouped_net_pp2_by_dp2_auto_partition_sgd_clipped_matches_reference_on_every_replica():
    """pp 2 x dp 2 on 4 ranks (``ddp: true``, interleaved = 1F1B), auto partition, SGD, 2 micro-batches,
    ``clip_master_grads`` below the gradient norm."""
    steps, micro, clip = 3, 2, 0.3
    results = run_torchrun(SCRIPT, 4, ["--steps", str(steps), "--optimizer", "sgd", "--clip", str(clip)],
                           smp_parameters={"partitions": 2, "microbatches": micro, "pipeline": "interleaved",
                                           "ddp": True})
    ref = check_against_reference(results, steps=steps, dp=2, micro=micro, optimizer="sgd", clip=clip)
    assert sorted((r["pp_rank"], r["dp_rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # The replicas saw different data (so the per-replica check is not vacuous) and ended with equal weights.
    assert ref["losses"][0][0] != ref["losses"][0][1]
    # Auto partition cut GroupedNet between its children's leaf modules; replicas hold the same stage parts.
    by_stage = {}
    for res in results:
        by_stage.setdefault(res["pp_rank"], []).append(res["local_modules"])
    assert all(len({tuple(m) for m in mods}) == 1 and mods[0] for mods in by_stage.values())
    assert set(by_stage[0][0]) | set(by_stage[1][0]) == {"net1.conv1", "net1.conv2", "net2.fc1", "net2.fc2"}

GPT2_SCRIPT = Path(__file__).parent / "pipeline" / "gpt2_first_stage_data.py"


def _gpt2_reference(steps: int, micro: int) -> dict:
    return micro_batched_reference(GPT2_SCRIPT, steps, micro,
                                   lambda script, params: torch.optim.SGD(params, lr=0.1, momentum=0.9))


@pytest.mark.slow
def test_gpt2_script_with_tokens_on_the_first_stage_only_matches_reference():
    """Hugging Face labels (``labels=input_ids``) reach the last stage from the first: GPT-2, pp 2, SGD."""
    steps, micro = 2, 2
    results = run_torchrun(GPT2_SCRIPT, 2, ["--steps", str(steps)],
                           smp_parameters={"partitions": 2, "microbatches": micro, "pipeline": "interleaved",
                                           "ddp": True})
    ref = _gpt2_reference(steps, micro)
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL)
        assert set(res["state"]) == set(ref["state"])
        for key, value in ref["state"].items():
            torch.testing.assert_close(torch.tensor(res["state"][key]), value, **TOL, msg=key)
