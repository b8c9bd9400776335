"""Activation checkpointing of a tensor-parallel block with dropout recomputes the forward's masks.

A tensor-parallel region draws dropout from its group's own random stream. The recomputation in
backward must see the masks of the first forward, so the gradients of a checkpointed step equal
those of the same step without checkpointing (same script seed, same region stream state).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import run_ranks


def _grads_with_and_without_checkpointing() -> dict[str, Any]:
    import smdistributed.modelparallel.torch as smp
    from tests.engine.workers.tp_workers import global_ids, hf_model, loss_of

    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    with smp.model_creation(tensor_parallelism=True):
        net = hf_model("gpt2", 0, dropout=0.3)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = loss_of("gpt2", model, ids)
        model.backward(loss)
        return loss

    ids = global_ids(0, 4)[smp.dp_rank() * 2:(smp.dp_rank() + 1) * 2]
    stream = smp.state.rng_manager  # the tensor-parallel group's stream (SMP's name)

    def one_step(script_seed: int) -> tuple[float, dict[str, Any]]:
        saved = stream._cpu_state.clone()
        torch.manual_seed(script_seed)
        loss = train_step(model, ids).reduce_mean().item()
        grads = {n: p.grad.detach().numpy().copy() for n, p in model.local_named_parameters() if p.grad is not None}
        opt.zero_grad()
        stream._cpu_state = saved  # the next call draws the same region masks again
        return loss, grads

    plain = one_step(7)
    other_masks = one_step(8)  # a different script seed: dropout outside the blocks changes the loss
    for name in net._smp2ds_tp_report.sharded_blocks:
        smp.set_activation_checkpointing(net.get_submodule(name))
    checkpointed = one_step(7)
    # A fresh model checkpointed at a parent of the blocks (the whole GPT2Model) gives the same too.
    smp.reset()
    with smp.model_creation(tensor_parallelism=True):
        net = hf_model("gpt2", 0, dropout=0.3)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0))
    smp.set_activation_checkpointing(net.transformer)
    parent = one_step(7)
    return {"plain": plain, "other": other_masks, "checkpointed": checkpointed, "parent": parent}


@pytest.mark.slow
def test_checkpointed_tensor_parallel_blocks_with_dropout_recompute_the_same_masks():
    for rank, got in enumerate(run_ranks(_grads_with_and_without_checkpointing, 2)):
        loss, grads = got["plain"]
        assert got["other"][0] != pytest.approx(loss, rel=1e-4), "dropout must change the loss (else nothing is tested)"
        for how in ("checkpointed", "parent"):
            ckpt_loss, ckpt_grads = got[how]
            assert ckpt_loss == pytest.approx(loss, rel=1e-6), how
            assert grads and set(grads) == set(ckpt_grads), how
            for name, g in grads.items():
                torch.testing.assert_close(torch.from_numpy(ckpt_grads[name]), torch.from_numpy(g), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=name, r=rank, h=how: f"rank {r} {h} {n}: {m}")
