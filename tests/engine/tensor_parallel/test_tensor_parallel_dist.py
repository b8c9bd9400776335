"""Tensor parallelism on real processes (gloo) equals single-process training.

One launch per layout checks several models (``smp.reset()`` between them): losses per rank and
step, gradient norms of clipping that clips, final weights (fp32, rtol 1e-4), the fraction of every
sharded weight each rank holds, the shard shapes of ``local_state_dict()``, activation checkpointing of
tensor-parallel blocks (``smp.set_activation_checkpointing``), and the fresh weights
``tensor_parallel_seed`` gives ``smp.nn`` modules. Layouts: tp 2 on 2 ranks (prescaled_batch false,
micro-batches 2, checkpoints: partial per tp rank and resume, full loaded at tp 1) and tp 2 x rdp 2
on 4 ranks with prescaled_batch true, and false with placement ``spread`` and ZeRO-1
(``shard_optimizer_state``) over the rdp group; tp 4 on 4 ranks.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.workers import tp_workers as tw

B = 4  # per-rank batch, split into 2 micro-batches where configured

RUNS = {
    # id: (world, smp config, phases)
    "tp2-mb2": (2, {"ddp": True, "tensor_parallel_degree": 2, "microbatches": 2, "tensor_parallel_seed": 7}, [
        {"model": "gpt2", "optimizer": "adamw", "seed": 1, "steps": 3, "clip": 0.5, "checkpoint": True},
        {"model": "mlp", "optimizer": "sgd", "seed": 2, "steps": 3, "clip": 0.2},
        {"model": "llama", "optimizer": "sgd", "seed": 3, "steps": 2},
        {"model": "bert", "optimizer": "adamw", "seed": 4, "steps": 2},
        {"model": "gpt_neox", "optimizer": "sgd", "seed": 5, "steps": 2},
        {"model": "gptj", "optimizer": "adamw", "seed": 12, "steps": 2},
        {"model": "gpt_neo", "optimizer": "sgd", "seed": 13, "steps": 2},
        {"model": "mistral", "optimizer": "adamw", "seed": 14, "steps": 2},
        {"model": "roberta", "optimizer": "sgd", "seed": 15, "steps": 2},
        {"model": "gpt2", "optimizer": "sgd", "seed": 16, "steps": 2, "activation_checkpointing": True},
        {"model": "gpt2", "optimizer": "sgd", "seed": 17, "steps": 2, "dropout": 0.2},
    ]),
    "tp2-rdp2-prescaled": (4, {"ddp": True, "tensor_parallel_degree": 2, "prescaled_batch": True,
                               "microbatches": 2}, [
        {"model": "gpt2", "optimizer": "sgd", "seed": 6, "steps": 3, "clip": 0.5},
        {"model": "mlp", "optimizer": "adamw", "seed": 7, "steps": 2},
    ]),
    "tp2-rdp2-spread-zero1": (4, {"ddp": True, "tensor_parallel_degree": 2, "placement_strategy": "spread",
                                  "shard_optimizer_state": True}, [
        {"model": "gpt2", "optimizer": "adamw", "seed": 8, "steps": 2},
        {"model": "llama", "optimizer": "sgd", "seed": 9, "steps": 2, "clip": 0.5},
    ]),
    "tp4": (4, {"ddp": True, "tensor_parallel_degree": 4, "microbatches": 2}, [
        {"model": "gpt2", "optimizer": "sgd", "seed": 10, "steps": 2, "clip": 0.5},
        {"model": "mlp", "optimizer": "adamw", "seed": 11, "steps": 2},
    ]),
}


def _close(got, want, what: str, atol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.as_tensor(got).float(), torch.as_tensor(want).float(), rtol=1e-4, atol=atol,
                               msg=lambda m: f"{what}: {m}")


# AdamW divides by the root of its second moment: for elements with gradients near 1e-7 (embedding rows few
# tokens hit) the order of float sums (tensor-parallel partial sums vs one matmul) moves an update of size lr
# (1e-2) by up to ~1e-5, so weights after AdamW get atol 3e-5; SGD keeps 1e-5.
ADAMW_ATOL = 3e-5


def _check_phase(rank: int, tp: int, phase: dict, got: dict, ref: dict) -> None:
    what = f"rank {rank} {phase['model']} {phase['optimizer']}"
    _close(got["losses"], [step[got["data_rank"]] for step in ref["losses"]], f"{what}: losses")
    if phase.get("clip"):
        _close(got["norms"], ref["norms"], f"{what}: gradient norms")
        assert max(ref["norms"]) > phase["clip"], "the test's clipping must clip"
    assert sorted(got["weights"]) == sorted(ref["weights"])
    atol = ADAMW_ATOL if phase["optimizer"] == "adamw" else 1e-5
    for key, value in ref["weights"].items():
        _close(got["weights"][key], value, f"{what}: weight {key}", atol)
    sharded = {n: (local, full) for n, (local, full) in got["shards"].items() if local != full}
    assert sharded, f"{what}: nothing was sharded"
    for name, (local, full) in sharded.items():
        assert local * tp == full, f"{what}: {name} holds {local} of {full} elements, not 1/{tp}"
        assert math.prod(got["local"][name].shape) == local, f"{what}: local_state_dict()[{name!r}] is not the shard"


def _check_dropout_keeps_replicas_equal(per_rank: list, p: int, tp: int) -> None:
    """With dropout and a different seed per rank, the tensor-parallel group still draws the same masks
    inside its regions (tensor_parallel_seed's stream): the block parameters every rank of the group holds
    whole (layer norms, row-parallel biases) stay identical; with per-rank masks they would drift apart."""
    local = [results[p]["local"] for results in per_rank]
    replicated = [k for k, v in local[0].items() if k.startswith("transformer.h.") and "ln_" in k or
                  k.endswith("c_proj.bias")]
    assert replicated
    for rank in range(1, tp):
        for key in replicated:
            torch.testing.assert_close(torch.as_tensor(local[rank][key]), torch.as_tensor(local[0][key]), rtol=0,
                                       atol=0, msg=lambda m, key=key: f"{key} differs across the group: {m}")
    before = tw.plain_model("gpt2", 17).state_dict()
    moved = max(float((torch.as_tensor(local[0][k]) - before[k]).abs().max()) for k in replicated)
    assert moved > 0, "the dropout phase must train the replicated parameters"


def _check_run(run_id: str, per_rank: list) -> None:
    world, config, phases = RUNS[run_id]
    tp = config["tensor_parallel_degree"]
    for p, phase in enumerate(phases):
        if phase.get("dropout"):
            _check_dropout_keeps_replicas_equal(per_rank, p, tp)
            continue
        ref = tw.reference(phase, per_rank[0][p]["data_ranks"], B)
        for rank, results in enumerate(per_rank):
            _check_phase(rank, tp, phase, results[p], ref)


@pytest.mark.slow
def test_tp2_trains_hugging_face_families_and_an_smp_mlp_like_single_process():
    per_rank = run_ranks(tw.run_tensor_parallel, 2, RUNS["tp2-mb2"][1], RUNS["tp2-mb2"][2], B)
    _check_run("tp2-mb2", per_rank)
    ranks = [r[-1]["ranks"] for r in per_rank]
    assert [r["tp"] for r in ranks] == [[0, 2], [1, 2]] or [tuple(r["tp"]) for r in ranks] == [(0, 2), (1, 2)]
    assert all(tuple(r["rdp"])[1] == 1 and tuple(r["dp"])[1] == 2 for r in ranks)
    gpt2 = per_rank[0][0]["report"]
    assert gpt2["sharded_blocks"] == ["transformer.h.0", "transformer.h.1"]
    mlp = per_rank[0][1]["report"]
    assert mlp["replaced"] == {"emb": "DistributedEmbedding", "up": "DistributedLinear",
                               "down": "DistributedLinear", "head": "DistributedLinear"}
    _check_fresh_weights(per_rank, RUNS["tp2-mb2"][1]["tensor_parallel_seed"])
    _check_checkpoints(per_rank)


def _check_checkpoints(per_rank: list) -> None:
    """GPT-2 phase: partial checkpoint at tp 2 -> fresh model -> resume gives the uninterrupted next
    step; the full checkpoint written at tp 2 loads into a plain (tp 1) model as the trained weights."""
    ref = tw.reference(RUNS["tp2-mb2"][2][0], 2, B)
    for rank, results in enumerate(per_rank):
        ckpt = results[0]["checkpoint"]
        assert {"model_0_0.pt", "model_0_1.pt", "optimizer_states_0_0.pt", "optimizer_states_0_1.pt"} <= \
            set(ckpt["files"]), ckpt["files"]
        for key, value in ckpt["uninterrupted"].items():
            _close(ckpt["resumed"][key], value, f"rank {rank}: resumed {key}")
        for key, value in ref["weights"].items():
            _close(ckpt["full_at_tp1"][key], value, f"rank {rank}: full checkpoint at tp 1, {key}", ADAMW_ATOL)


def _check_fresh_weights(per_rank: list, seed: int) -> None:
    """tensor_parallel_seed's effect: ``smp.nn`` modules built directly hold, joined over the tensor-parallel
    ranks, the full fresh weights drawn from seed + the module's index in creation order (the MLP phase).
    The MLP's ``nn.Linear``/``nn.Embedding`` layers replaced by them keep the weights they were built with."""
    expected = tw.fresh_mlp_weights(seed)
    pieces = [results[1]["fresh"] for results in per_rank]
    joined = {}
    for key in expected:
        dim = 1 if key == "emb.weight" else 0  # DistributedEmbedding splits embedding_dim, DistributedLinear out
        joined[key] = torch.cat([torch.as_tensor(p[key]) for p in pieces], dim=dim)
        _close(joined[key], expected[key], f"fresh {key}")
    other = tw.fresh_mlp_weights(seed + 100)
    assert not torch.allclose(joined["up.weight"], other["up.weight"])
    built = tw.plain_model("mlp", RUNS["tp2-mb2"][2][1]["seed"]).state_dict()
    for results in per_rank:
        for key, value in built.items():
            _close(results[1]["kept"][key], value, f"kept {key}", atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("run_id", ["tp2-rdp2-prescaled", "tp2-rdp2-spread-zero1", "tp4"])
def test_tp2_rdp2_and_tp4_on_four_ranks_match_single_process(run_id):
    world, config, phases = RUNS[run_id]
    per_rank = run_ranks(tw.run_tensor_parallel, world, config, phases, B)
    _check_run(run_id, per_rank)
    groups = [r[-1]["ranks"] for r in per_rank]
    if config["tensor_parallel_degree"] == 4:
        assert all(list(g["tp_group"]) == [0, 1, 2, 3] and tuple(g["rdp"])[1] == 1 for g in groups)
        return
    if config.get("placement_strategy") == "spread":  # TPD: D varies fastest
        assert [list(g["tp_group"]) for g in groups] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    else:
        assert [list(g["tp_group"]) for g in groups] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(tuple(g["rdp"])[1] == 2 and tuple(g["dp"])[1] == 4 for g in groups)


@pytest.mark.slow
def test_what_tensor_parallelism_refuses_is_named():
    per_rank = run_ranks(tw.run_refusals, 2)
    for out in per_rank:
        assert out["heads"].startswith("SMPUnsupportedError: GPT2LMHeadModel: tensor_parallel_degree 2 must divide "
                                       "the attention head counts (num_attention_heads=3"), out["heads"]
        assert out["max_norm"].startswith("SMPUnsupportedError: smp.nn.DistributedEmbedding with max_norm or sparse "
                                          "gradients cannot be split"), out["max_norm"]
        assert "needs equal batch sizes; got [4, 2]" in out["batches"], out["batches"]
        assert "prescaled_batch is false, so the 2 tensor-parallel ranks [0, 1] join their batches" in out["batches"]
