"""An SMP-style tensor-parallel GPT-2 script (``tensor_parallel/gpt2_tp.py``), launched with ``torchrun`` on
2 CPU ranks (and on 4 with pipeline_parallel_degree 2: tp 2 inside each stage), matches a single-process
PyTorch run of the same model, seed and tokens (the union of the data-parallel ranks' batches): per-rank
losses, gradient norms (clipping that clips) and final weights; every rank holds half of each sharded block
weight; the full checkpoint loads into a plain model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.scripts.torchrun_launch import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "tensor_parallel" / "gpt2_tp.py"
ADAMW_ATOL = 3e-5
"""AdamW turns float-order noise in near-zero gradients into steps of size lr (see test_tensor_parallel_dist)."""


def _script():
    spec = importlib.util.spec_from_file_location(SCRIPT.stem, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference(data_ranks: int, steps: int, batch: int, clip: float) -> dict:
    from transformers import AutoModelForCausalLM, set_seed

    script = _script()
    set_seed(12345)
    model = AutoModelForCausalLM.from_config(script.model_config())
    opt = torch.optim.AdamW(script.get_param_groups_by_weight_decay(model, 0.01), lr=0.01, betas=(0.9, 0.95),
                            eps=1e-6)
    data = script.tokens(steps, batch * data_ranks)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        per_rank = [model(input_ids=data[step, r * batch:(r + 1) * batch], labels=data[step, r * batch:(r + 1) * batch]
                          ).loss for r in range(data_ranks)]
        losses.append([x.item() for x in per_rank])
        torch.stack(per_rank).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {"losses": losses, "norms": norms, "weights": model.state_dict()}


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_smp_gpt2_tensor_parallel_script_matches_single_process(pp, tmp_path):
    results = run_torchrun(SCRIPT, 2 * pp, ["--checkpoint-dir", str(tmp_path), "--pipeline-parallel-degree", str(pp)],
                           timeout_s=400)
    ref = _reference(results[0]["data_ranks"], 3, 4, 0.5)
    assert max(ref["norms"]) > 0.5, "the test's clipping must clip"
    assert sorted(res["pp"][0] for res in results) == sorted(list(range(pp)) * 2)
    for res in results:
        assert res["tp"][1] == 2 and res["data_ranks"] == 2 and res["pp"][1] == pp
        torch.testing.assert_close(torch.tensor(res["losses"]),
                                   torch.tensor([step[res["data_rank"]] for step in ref["losses"]]), rtol=1e-4, atol=0)
        torch.testing.assert_close(torch.tensor(res["grad_norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=0)
        for key, value in ref["weights"].items():
            torch.testing.assert_close(torch.tensor(res["weights"][key]), value.flatten(), rtol=1e-4, atol=ADAMW_ATOL,
                                       msg=lambda m, key=key: f"{key}: {m}")
        attn = "transformer.h.0.attn.c_attn.weight"
        assert res["local_numel"][attn] * 2 == res["full_numel"][attn]
    full = {k: v for k, v in torch.load(tmp_path / "full", weights_only=False).items() if not k.startswith("_smp")}
    plain = _script()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(plain.model_config())
    model.load_state_dict(full, strict=True)
    for key, value in ref["weights"].items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-4, atol=ADAMW_ATOL)
