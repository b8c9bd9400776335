"""Structurally cut Hugging Face decoders in real processes (gloo, CPU) against single-process HF.

Two spawned runs, each training every family of ``DIST_FAMILIES`` in one set of ranks: pp 2 on 2
ranks (1F1B) and pp 2 x dp 2 on 4 ranks (GPipe). 4 micro-batches per step, a padding attention
mask, ``labels=input_ids`` (the RoBERTa heads: class labels, masked-LM labels or answer spans, with
``test_pipeline_dist``'s batches and step functions), AdamW, 3 steps, through the SMP-style step function of
``test_pipeline_dist`` (``model(...)`` then ``model.backward(loss)``). The reference trains the
same tiny model in one process on the union of the data-parallel ranks' batches, each
micro-batch loss scaled by 1/(micro-batches x dp) as SMP's averaging does; per-micro-batch losses
of every step and the final weights must agree on every rank.

AdamW's ``eps`` is 1e-6: key-projection biases (Qwen2, Phi) get gradients that are zero up to
float noise (softmax ignores a constant shift), and a smaller ``eps`` turns that noise into
lr-sized steps, which would test Adam's amplification of rounding rather than the pipeline. The
RoBERTa heads train with SGD (momentum), as BERT's do in ``test_pipeline_dist``: the question-answering
bias shifts every token's span logit alike, so its gradient is such noise too, even for Adam at 1e-6.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.pipeline.test_pipeline_dist import MICRO, STEP_FNS, STEPS, _Plain, batch, loss_of, micro_calls
from tests.engine.pipeline.test_pipeline_families_more import ROBERTA, make_roberta
from tests.engine.pipeline.test_pipeline_hf_decoders import FAMILIES, make_decoder
from tests.scripts.pipeline_reference import micro_batched_reference

DIST_FAMILIES = ("mistral", "qwen2", "qwen3", "gemma", "phi", "gpt_neox", "falcon", "opt", "opt_proj", "gemma2",
                 "granite", "cohere", "bloom", "roberta_cls", "roberta_mlm", "roberta_qa")
TIED = {"gemma": ("model.embed_tokens.weight", "lm_head.weight"),
        "falcon": ("transformer.word_embeddings.weight", "lm_head.weight"),
        "opt": ("model.decoder.embed_tokens.weight", "lm_head.weight"),
        "opt_proj": ("model.decoder.embed_tokens.weight", "lm_head.weight"),
        "gemma2": ("model.embed_tokens.weight", "lm_head.weight"),
        "cohere": ("model.embed_tokens.weight", "lm_head.weight"),
        "bloom": ("transformer.word_embeddings.weight", "lm_head.weight"),
        "roberta_mlm": ("roberta.embeddings.word_embeddings.weight", "lm_head.decoder.weight")}
# The RoBERTa heads train on test_pipeline_dist's BERT batches and step functions; decoders on its LM ones.
KIND = {"roberta_cls": "bert_cls", "roberta_mlm": "bert_mlm", "roberta_qa": "bert_qa"}
TOL = {"rtol": 1e-5, "atol": 1e-6}


def make_model(family: str):
    return make_roberta(family) if family in ROBERTA else make_decoder(family)


def kind_of(family: str) -> str:
    return KIND.get(family, "llama")


def make_optimizer(params, family: str = "llama"):
    if family in KIND:  # test_pipeline_dist's SGD for the BERT-style heads (see below)
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


def _train(family: str, pipeline: str) -> dict:
    import torch.distributed as dist

    from smp2ds.engine.pipeline import build_pipeline, clear_partitions, plan_for
    from smp2ds.translator.topology import Topology

    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.for_world(world, pp=2, placement="cluster")
    clear_partitions()
    model = make_model(family)
    cfg = {"pipeline_parallel_degree": 2, "microbatches": MICRO, "pipeline": pipeline, "ddp": True,
           "placement_strategy": topo.placement, "auto_partition": True}
    ds_config = {"gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 0}}
    runner = build_pipeline(model, plan_for(cfg, world, ds_config), topo)
    runner.attach_optimizer(make_optimizer(model.parameters(), family))
    dp_rank = topo.coords(rank).rdp_rank
    losses = []
    for step in range(STEPS):
        kind = kind_of(family)
        results = runner.run_step(STEP_FNS[kind], micro_calls(runner, batch(kind, step, topo.rdp), dp_rank))
        runner.optimizer_step()
        losses.append([loss_of(r) for r in results])
    return {"rank": rank, "stage": runner.stage, "dp_rank": dp_rank, "losses": losses,
            "split": runner.partition.describe(), "local_keys": sorted(runner.local_state_dict()),
            "state": {k: v.numpy() for k, v in runner.state_dict().items()}}


def _run_families(pipeline: str) -> list[dict]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ["SMP2DS_INIT_METHOD"], rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        return [_train(family, pipeline) for family in DIST_FAMILIES]
    finally:
        dist.destroy_process_group()


def reference(family: str, dp: int) -> dict:
    """Single-process Hugging Face training on the same batches, scaled as SMP averages."""
    model = make_model(family)
    opt = make_optimizer(model.parameters(), family)
    plain = _Plain(model, 1.0 / (MICRO * dp))
    kind = kind_of(family)
    losses = []  # losses[step][dp_rank] = per-micro-batch losses
    for step in range(STEPS):
        tensors = batch(kind, step, dp)
        losses.append([[loss_of(STEP_FNS[kind](*args)) for args, _ in micro_calls(plain, tensors, r)]
                       for r in range(dp)])
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def check_family(family: str, per_rank: list[dict], dp: int) -> None:
    ref = reference(family, dp)
    initial = make_model(family).state_dict()
    assert any(not torch.allclose(initial[k], v) for k, v in ref["state"].items())  # it did train
    for res in per_rank:
        label = f"{family} rank {res['rank']}"
        expected = [ref["losses"][s][res["dp_rank"]] for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(expected), **TOL, msg=label)
        assert set(res["state"]) == set(ref["state"]), label
        for key, value in ref["state"].items():
            torch.testing.assert_close(torch.from_numpy(res["state"][key]), value, **TOL, msg=f"{label} {key}")
    # Each stage holds its own layers only; a tied embedding/head weight lives on both ends.
    by_stage = {res["stage"]: set(res["local_keys"]) for res in per_rank}
    assert by_stage[0] | by_stage[1] == set(ref["state"])
    assert by_stage[0] & by_stage[1] == set(TIED.get(family, ())), family
    assert all(res["split"].startswith("pipeline split (auto") for res in per_rank), per_rank[0]["split"]


@pytest.mark.slow
def test_every_family_at_pp2_on_two_ranks_matches_single_process_hf_training():
    results = run_ranks(_run_families, 2, "interleaved")
    for i, family in enumerate(DIST_FAMILIES):
        per_rank = [results[r][i] for r in range(2)]
        assert [res["stage"] for res in per_rank] == [0, 1]
        check_family(family, per_rank, dp=1)


@pytest.mark.slow
def test_every_family_at_pp2_by_dp2_on_four_ranks_matches_single_process_hf_training():
    results = run_ranks(_run_families, 4, "simple")
    for i, family in enumerate(DIST_FAMILIES):
        per_rank = [results[r][i] for r in range(4)]
        assert sorted((res["stage"], res["dp_rank"]) for res in per_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        check_family(family, per_rank, dp=2)
    assert set(DIST_FAMILIES) <= set(FAMILIES) | set(ROBERTA)


# ---- an unchanged SMP script under the real launcher -------------------------------------------------
SCRIPT = Path(__file__).parents[2] / "scripts" / "pipeline" / "hf_decoder_causal_lm.py"


def _script_reference(steps: int, micro: int) -> dict:
    return micro_batched_reference(SCRIPT, steps, micro, lambda script, params: script.make_optimizer(params))


@pytest.mark.slow
def test_smp_gpt_style_script_with_a_qwen3_from_config_runs_under_torchrun_at_pp2():
    """``AutoModelForCausalLM.from_config`` + ``smp.DistributedModel`` + ``@smp.step``/``model.backward``,
    pp 2 on 2 ranks (1F1B), AdamW; a model the structural cut cannot follow (a Falcon with ALiBi) is refused at
    ``smp.DistributedModel`` time on every rank."""
    from tests.scripts.torchrun_launch import run_torchrun

    steps, micro = 2, 2
    results = run_torchrun(SCRIPT, 2, ["--steps", str(steps)],
                           smp_parameters={"partitions": 2, "microbatches": micro, "pipeline": "interleaved",
                                           "ddp": True})
    ref = _script_reference(steps, micro)
    assert [r["pp_rank"] for r in results] == [0, 1]
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), **TOL)
        assert set(res["state"]) == set(ref["state"])
        for key, value in ref["state"].items():
            torch.testing.assert_close(torch.tensor(res["state"][key]), value, **TOL, msg=key)
        assert res["refused"].startswith(
            "UnsupportedModelError: pipeline parallelism cannot split a transformers.models.falcon.modeling_falcon."
            "FalconForCausalLM: it is not cut as a decoder (embedding, ModuleList of blocks, final norm, head) because "
            "config.alibi=True needs ALiBi biases built per call"), res["refused"]


# ---- tensor parallelism inside the stages -------------------------------------------------------------
@pytest.mark.slow
def test_mistral_and_gpt_neox_at_pp2_by_tp2_match_single_process():
    """pp 2 x tp 2 on 4 ranks through ``smp.DistributedModel``: the blocks are tensor-parallel regions
    (a ``forward(*args, **kwargs)`` mixed in front of the block class) before the structural cut; the
    cut must still hand each block its padding mask and rotary embedding (the harness of
    ``test_tp_pipeline_dist``: losses, clipped gradient norms and weights against one process)."""
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd
    from tests.engine.workers import tp_workers as tw

    config = {"ddp": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2}
    phases = [{"model": "mistral", "optimizer": "sgd", "seed": 24, "steps": 2, "clip": 0.3},
              {"model": "gpt_neox", "optimizer": "adamw", "seed": 25, "steps": 2}]
    per_rank = run_ranks(tw.run_tensor_parallel, 4, config, phases, tpd.B)
    for p, phase in enumerate(phases):
        ref = tw.reference(phase, per_rank[0][p]["data_ranks"], tpd.B)
        for rank, results in enumerate(per_rank):
            got = dict(results[p])
            got["shards"] = {n: sizes for n, sizes in got["shards"].items() if n in got["local"]}
            assert len(got["shards"]) < len(results[p]["shards"]), f"rank {rank}: a stage holds every parameter"
            tpd._check_phase(rank, 2, phase, got, ref)
