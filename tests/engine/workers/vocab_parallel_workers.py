"""Rank body for ``test_distribute_embedding_dist.py``: Hugging Face GPT-2 (tied head) and GPT-NeoX (untied
head) built inside ``smp.model_creation(tensor_parallelism=True, distribute_embedding=True, ...)``, replaced
by ``smp.nn.DistributedTransformerLMHead`` with the vocabulary split over tp 2, trained through smp.

Data and reference: :mod:`tests.engine.workers.transformer_workers` (rows by dp_rank, right padding with -100
labels; the Hugging Face model trained single-process on the union of the ranks' rows).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.engine.workers import transformer_workers as tt
from tests.engine.workers.train_workers import plain


def _phase(smp: Any, phase: dict, b: int) -> dict:
    with smp.model_creation(tensor_parallelism=True, distribute_embedding=True, **tt.SETTINGS):
        net = tt.hf_of(phase)
    model = smp.DistributedModel(net)
    module = model.get_module()
    rank, ranks = smp.dp_rank(), smp.dp_size()
    mine = slice(rank * b, (rank + 1) * b)
    ids, mask = tt.batch(100, ranks * b)
    module.eval()
    with torch.no_grad():  # without labels the logits are joined over the group
        out: dict[str, Any] = {"logits": model(input_ids=ids[mine], attention_mask=mask[mine]).logits}
    module.train()
    full = model.state_dict()
    out["shards"] = {n: (p.numel(), full[n].numel()) for n, p in model.named_parameters()}
    out["vocab_parallel"] = module.vocab_parallel
    opt = smp.DistributedOptimizer(tt.make_optimizer(phase["optimizer"], model.parameters()))
    logits_given: list[bool] = []

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        output = model(input_ids=ids, attention_mask=mask, labels=tt.labels_of(ids, mask))
        logits_given.append(output.logits is not None)
        model.backward(output["loss"])
        return output["loss"]

    out["losses"] = []
    for step in range(phase["steps"]):
        ids, mask = tt.batch(step, ranks * b)
        out["losses"].append(train_step(model, ids[mine], mask[mine]).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    out["weights"] = tt.to_hf_names(phase, model.state_dict())
    out["logits_given"], out["data_rank"] = logits_given, rank
    return out


def run(b: int, phases: list[dict]) -> list[dict]:
    import smdistributed.modelparallel.torch as smp

    smp.init({"ddp": True, "tensor_parallel_degree": 2})
    results = []
    for phase in phases:
        smp.reset()
        results.append(_phase(smp, phase, b))
    try:
        smp.nn.DistributedTransformerLMHead(num_layers=1, num_attention_heads=2, attention_head_size=4, hidden_size=8,
                                            intermediate_size=16, vocab_size=47, distribute_embedding=True)
        results.append("no error")
    except Exception as exc:  # noqa: BLE001 - the message is the result
        results.append(f"{type(exc).__name__}: {exc}")
    smp.barrier()
    return plain(results)
