"""T5 and Flan-T5 pipelined in real processes (gloo, CPU) against single-process Hugging Face training.

Two spawned runs with ``test_pipeline_dist``'s harness, step function and batches (``model(input_ids=...,
attention_mask=..., labels=input_ids)`` then ``model.backward(loss)``, a padding mask, 4 micro-batches, 3
steps): pp 2 on 2 ranks (1F1B) and pp 2 x dp 2 on 4 ranks (GPipe). Each run trains three splits of the tiny
models of ``test_pipeline_t5``: the automatic one, a manual one with the stage boundary inside the encoder
(the encoder's relative position bias and the shared embedding then live on both stages, and the encoder
output crosses to the decoder stage with its gradient), and a manual one inside the decoder (the decoder's
relative position bias and the tied ``lm_head`` on both stages). The reference trains the same model in one
process on the union of the data-parallel ranks' batches, each micro-batch loss scaled by 1/(micro-batches x
dp); per-micro-batch losses and final weights must agree on every rank. AdamW with ``eps`` 1e-6, as the
decoder families' test uses.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.pipeline.test_pipeline_dist import MICRO, STEP_FNS, STEPS, _Plain, batch, loss_of, micro_calls
from tests.engine.pipeline.test_pipeline_t5 import make_t5

TOL = {"rtol": 1e-5, "atol": 1e-6}
SHARED = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
ENC_REL = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
DEC_REL = "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
# (model kind, split, keys held by both stages; None: whatever the automatic split shares)
CASES = (("t5", "auto", None),
         ("flan_t5", "in_encoder", (*SHARED, ENC_REL)),
         ("t5", "in_decoder", (*SHARED, "lm_head.weight", DEC_REL)))


def _place(model, split: str) -> None:
    from smp2ds.engine.pipeline import set_partition

    if split == "in_encoder":
        later = [model.encoder.block[2], model.encoder.final_layer_norm, model.decoder, model.lm_head]
    else:
        later = [model.decoder.block[1], model.decoder.final_layer_norm, model.lm_head]
    for module in later:
        set_partition(module, 1)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.01)


def _train(kind: str, split: str, pipeline: str) -> dict:
    import torch.distributed as dist

    from smp2ds.engine.pipeline import build_pipeline, clear_partitions, plan_for
    from smp2ds.translator.topology import Topology

    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.for_world(world, pp=2, placement="cluster")
    clear_partitions()
    model = make_t5(kind)
    auto = split == "auto"
    if not auto:
        _place(model, split)
    cfg = {"pipeline_parallel_degree": 2, "microbatches": MICRO, "pipeline": pipeline, "ddp": True,
           "placement_strategy": topo.placement, "auto_partition": auto, "default_partition": 0}
    ds_config = {"gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": 0}}
    runner = build_pipeline(model, plan_for(cfg, world, ds_config), topo)
    runner.attach_optimizer(make_optimizer(model.parameters()))
    dp_rank = topo.coords(rank).rdp_rank
    losses = []
    for step in range(STEPS):
        results = runner.run_step(STEP_FNS["llama"], micro_calls(runner, batch("llama", step, topo.rdp), dp_rank))
        runner.optimizer_step()
        losses.append([loss_of(r) for r in results])
    clear_partitions()
    return {"rank": rank, "stage": runner.stage, "dp_rank": dp_rank, "losses": losses,
            "split": runner.partition.describe(), "local_keys": sorted(runner.local_state_dict()),
            "state": {k: v.numpy() for k, v in runner.state_dict().items()}}


def _run_cases(pipeline: str) -> list[dict]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ["SMP2DS_INIT_METHOD"], rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        return [_train(kind, split, pipeline) for kind, split, _ in CASES]
    finally:
        dist.destroy_process_group()


def reference(kind: str, dp: int) -> dict:
    """Single-process Hugging Face training on the same batches, scaled as SMP averages."""
    model = make_t5(kind)
    opt = make_optimizer(model.parameters())
    plain = _Plain(model, 1.0 / (MICRO * dp))
    losses = []  # losses[step][dp_rank] = per-micro-batch losses
    for step in range(STEPS):
        tensors = batch("llama", step, dp)
        losses.append([[loss_of(STEP_FNS["llama"](*args)) for args, _ in micro_calls(plain, tensors, r)]
                       for r in range(dp)])
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def check_case(case: tuple, per_rank: list[dict], dp: int) -> None:
    kind, split, shared = case
    ref = reference(kind, dp)
    initial = make_t5(kind).state_dict()
    assert any(not torch.allclose(initial[k], v) for k, v in ref["state"].items())  # it did train
    for res in per_rank:
        label = f"{kind} {split} rank {res['rank']}"
        expected = [ref["losses"][s][res["dp_rank"]] for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(expected), **TOL, msg=label)
        assert set(res["state"]) == set(ref["state"]), label
        for key, value in ref["state"].items():
            torch.testing.assert_close(torch.from_numpy(res["state"][key]), value, **TOL, msg=f"{label} {key}")
    by_stage = {res["stage"]: set(res["local_keys"]) for res in per_rank}
    assert by_stage[0] | by_stage[1] == set(ref["state"])
    both = by_stage[0] & by_stage[1]
    if shared is None:  # only tied weights may live on both stages
        assert both <= {*SHARED, "lm_head.weight", ENC_REL, DEC_REL}, both
    else:
        assert both == set(shared), (split, both, per_rank[0]["split"])
    method = "auto" if split == "auto" else "manual"
    assert all(res["split"].startswith(f"pipeline split ({method}") for res in per_rank), per_rank[0]["split"]


@pytest.mark.slow
def test_t5_at_pp2_on_two_ranks_matches_single_process_hf_training():
    results = run_ranks(_run_cases, 2, "interleaved")
    for i, case in enumerate(CASES):
        per_rank = [results[r][i] for r in range(2)]
        assert [res["stage"] for res in per_rank] == [0, 1]
        check_case(case, per_rank, dp=1)


@pytest.mark.slow
def test_t5_at_pp2_by_dp2_on_four_ranks_matches_single_process_hf_training():
    results = run_ranks(_run_cases, 4, "simple")
    for i, case in enumerate(CASES):
        per_rank = [results[r][i] for r in range(4)]
        assert sorted((res["stage"], res["dp_rank"]) for res in per_rank) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        check_case(case, per_rank, dp=2)
