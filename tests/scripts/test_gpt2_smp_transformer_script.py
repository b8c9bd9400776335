"""``gpt2_transformer/train_gpt_simple.py``, written like SMP's GPT-2 example (Hugging Face's weight init
skipped with ``PreTrainedModel.init_weights = lambda x: None`` before ``AutoModelForCausalLM.from_config``
inside ``model_creation(tensor_parallelism=True, ...)``, ``seq_layers`` partition assignment,
activation checkpointing of ``.attention`` / ``.output``, translate functions for checkpoints), runs
unchanged under ``torchrun`` at tensor_parallel_degree 1 (2 data-parallel ranks), 2, and 2 with
pipeline_parallel_degree 2 (4 ranks: the distributed transformer cut into stages; also with
``--model-type gpt_neo``, a GPT-Neo with a global and a local attention layer), and 2 with
sharded_data_parallel_degree 2 (4 ranks, prescaled_batch, delayed parameter initialization; SMP clips
gradients at 1.0 with sharded data parallelism, and so does the reference). As SMP's script, it runs
with ``flash_attention=1`` by default (attention by scaled_dot_product_attention); the runs from given
weights use ``--flash-attention 0`` (the eager attention).

Started from its own initialisation (the script's default), the distributed model's starting weights
(saved by the script in Hugging Face's names) are the distributed transformer's fresh ones, the same
at every layout as in one process at tp 1, and its first losses are near ln(vocab); started from given
Hugging Face weights (``--init-from``), it starts from those. Either way it equals single-process
Hugging Face training from the same starting weights (losses per rank and the final weights, rtol
1e-4), and the checkpoint it writes in Hugging Face's names loads into a plain Hugging Face model and
gives the distributed model's logits."""

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


def _own_initial_weights(script, model_type: str, monkeypatch) -> dict:
    """The replaced model's fresh weights (Hugging Face names) built here in one process at tp 1 the way
    the script builds it: Hugging Face's init skipped, the first replacement of a process, seed 0."""
    import dataclasses

    import transformers

    from smp2ds.engine.nn.parallel import marks
    from smp2ds.engine.nn.parallel.context import ParallelContext
    from smp2ds.engine.nn.parallel.group import SINGLE
    from smp2ds.engine.nn.parallel.rng import RngManager
    from smp2ds.engine.tensor_parallel.transformer_replacement import replace_marked

    monkeypatch.setattr(transformers.PreTrainedModel, "init_weights", lambda x: None)
    try:
        with marks.tensor_parallelism(fused_softmax=True):
            hf = transformers.AutoModelForCausalLM.from_config(script.model_config(model_type))
        # one process, no tensor parallelism, tensor_parallel_seed SMP's default 0
        fresh_stream = ParallelContext(tp=dataclasses.replace(SINGLE, rng=RngManager(0)))  # nothing drawn from it yet
        return script.MODELS[model_type][2](replace_marked(hf, fresh_stream).state_dict())
    finally:
        monkeypatch.undo()


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,sdp,model_type,start", [
    (1, 1, 1, "gpt2", "own"), (2, 1, 1, "gpt2", "own"), (2, 2, 1, "gpt2", "own"), (2, 1, 2, "gpt2", "own"),
    (2, 2, 1, "gpt_neo", "own"), (2, 1, 1, "gpt2", "given"), (2, 1, 2, "gpt2", "given")])
def test_smp_gpt2_transformer_script_runs_unchanged_and_matches_hugging_face(tp, pp, sdp, model_type, start,
                                                                             tmp_path, monkeypatch):
    script = _script()
    args = ["--tensor-parallel-degree", str(tp), "--pipeline-parallel-degree", str(pp), "--steps", str(STEPS),
            "--train-batch-size", str(B), "--adam-eps", str(EPS), "--checkpoint-dir", str(tmp_path),
            "--model-type", model_type]
    if start == "given":
        torch.manual_seed(31)
        given = script.MODELS[model_type][0](script.model_config(model_type)).state_dict()
        torch.save(given, tmp_path / "given.pt")
        args += ["--init-from", str(tmp_path / "given.pt"), "--flash-attention", "0"]  # the eager attention too
    if sdp > 1:  # SMP 1.15+: tensor parallelism with sharded data parallelism needs prescaled_batch
        args += ["--sharded-data-parallel-degree", str(sdp), "--prescaled-batch", "1", "--delayed-param", "1"]
    reports = run_torchrun(SCRIPT, 2 * pp * sdp, args, timeout_s=400)
    init = torch.load(tmp_path / "initial_hf.pt")
    want_init = given if start == "given" else _own_initial_weights(script, model_type, monkeypatch)
    assert set(init) == set(want_init)
    for key, value in want_init.items():
        torch.testing.assert_close(init[key], value, rtol=0, atol=0, msg=key)
    losses, weights = _reference(script, init, 2, clip=1.0 if sdp > 1 else None, model_type=model_type)
    if start == "own":  # a fresh model predicts every token nearly alike (~20 tokens per rank: 0.1 of noise)
        assert all(abs(v - np.log(script.VOCAB)) < 0.1 for v in losses[0]), losses[0]
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


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,sdp", [(2, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_fine_tune_path_starts_from_hugging_face_weights_and_saves_hugging_face_names(tp, pp, sdp, tmp_path):
    """``--fine-tune 1 --save-final-full-model 1``: the run equals single-process Hugging Face fine-tuning from
    the pretrained weights, and the fullmodel.pt it writes is that fine-tuned model in Hugging Face's names."""
    import transformers

    script = _script()
    torch.manual_seed(31)
    pretrained = transformers.GPT2LMHeadModel(script.model_config("gpt2"))
    pretrained.save_pretrained(tmp_path / "pretrained")
    args = ["--tensor-parallel-degree", str(tp), "--pipeline-parallel-degree", str(pp), "--steps", str(STEPS),
            "--train-batch-size", str(B), "--adam-eps", str(EPS), "--fine-tune", "1", "--model-name",
            str(tmp_path / "pretrained"), "--model-dir", str(tmp_path), "--save-final-full-model", "1"]
    if sdp > 1:
        args += ["--sharded-data-parallel-degree", str(sdp), "--prescaled-batch", "1", "--delayed-param", "1"]
    reports = run_torchrun(SCRIPT, 2 * pp * sdp, args, timeout_s=400)
    losses, weights = _reference(script, pretrained.state_dict(), 2, clip=1.0 if sdp > 1 else None)
    saved = torch.load(tmp_path / "fullmodel.pt")
    assert set(saved) == set(weights)
    for key, want in weights.items():
        torch.testing.assert_close(saved[key], want, rtol=1e-4, atol=1e-5, msg=key)
    for rep in reports:
        np.testing.assert_allclose(rep["losses"], [s[rep["dp_rank"]] for s in losses], rtol=1e-4, atol=1e-6)
