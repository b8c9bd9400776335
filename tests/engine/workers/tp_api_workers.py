"""Rank bodies and single-process references for ``test_tp_api_dist.py``.

Models besides ``tp_workers``' Hugging Face ones:

* ``VocabNet``: an ``nn.Embedding`` and the head ``nn.Linear`` marked with
  ``smp.tensor_parallelism(vocab_parallel=True)`` (replaced by ``smp.nn.DistributedEmbedding`` with the
  vocabulary split, its padding row in tp rank 1's half, and ``DistributedLinear``) and a position table built directly as ``smp.nn.DistributedEmbedding(..., vocab_parallel=True)``;
* ``UserNet``: user classes registered with ``smp.tp_register`` (``FFN`` -> ``DistFFN``, with init,
  forward and return hooks) and ``smp.tp_register_with_module`` (``Mixer`` -> ``DistMixer``).

The distributed versions keep the original parameter names, so the reference's state dict loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp
from tests.engine.workers import tp_workers as tw
from tests.engine.workers.train_workers import plain

VOCAB, SEQ, WIDTH = tw.VOCAB, tw.SEQ, 16
PAD = 40  # in the second half of the vocabulary: tp rank 1 owns the padding row at tp 2


# ---- user registrations --------------------------------------------------------------------------
class DistFFN(smp.nn.DistributedModule):
    """The user's tensor-parallel FFN: other constructor and call signatures, tuple output."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = smp.nn.DistributedLinear(dim, hidden)
        self.fc2 = smp.nn.DistributedLinear(hidden, dim)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor, factor: float) -> tuple[torch.Tensor]:
        self.calls += 1
        return (factor * self.fc2(torch.relu(self.fc1(x))),)


@smp.tp_register(DistFFN, init_hook=lambda width, hidden: ((), {"dim": width, "hidden": hidden}),
                 forward_hook=lambda x, scale=1.0: ((x,), {"factor": scale}), return_hook=lambda out: out[0])
class FFN(torch.nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, hidden)
        self.fc2 = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return scale * self.fc2(torch.relu(self.fc1(x)))


class Mixer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class DistMixer(smp.nn.DistributedModule):
    def __init__(self, width: int):
        super().__init__()
        self.proj = smp.nn.DistributedLinear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


smp.tp_register_with_module(Mixer, DistMixer)


class UserNet(torch.nn.Module):
    def __init__(self, tp: bool = False):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        with smp.tensor_parallelism(enabled=tp):
            self.ffn = FFN(WIDTH, 32)
            self.mix = Mixer(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.register_buffer("offset", torch.zeros(WIDTH), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.offset
        h = self.mix(h + self.ffn(h, scale=0.5))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class VocabNet(torch.nn.Module):
    def __init__(self, tp: bool = False):
        super().__init__()
        with smp.tensor_parallelism(enabled=tp, vocab_parallel=True):
            self.emb = torch.nn.Embedding(VOCAB, WIDTH, padding_idx=PAD)
            self.head = torch.nn.Linear(WIDTH, VOCAB)  # DistributedLinear takes no vocab_parallel: skipped
        self.pos = smp.nn.DistributedEmbedding(SEQ, WIDTH, vocab_parallel=True) if tp else \
            torch.nn.Embedding(SEQ, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(ids) + self.pos(torch.arange(ids.shape[1]).expand_as(ids)))
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def ids_with_padding(step: int, rows: int) -> torch.Tensor:
    ids = tw.global_ids(step, rows)
    ids[:, -1] = PAD  # the padding row's gradient must stay zero
    return ids


BUILDERS: dict[str, Callable[[bool], torch.nn.Module]] = {"user": UserNet, "vocab": VocabNet}


def build(kind: str, seed: int, tp: bool) -> torch.nn.Module:
    if kind in ("gpt2",):
        return tw.hf_model(kind, seed)
    torch.manual_seed(seed)
    return BUILDERS[kind](tp)


def loss_of(kind: str, model: Any, ids: torch.Tensor) -> torch.Tensor:
    if kind == "gpt2":
        return tw.loss_of(kind, model, ids)
    return model(ids, ids.roll(1, dims=1))


def reference(kind: str, seed: int, steps: int, data_ranks: int, b: int, lr_scale: float = 1.0) -> dict:
    """Single-process training on the union of the data-parallel ranks' batches (SGD; ``lr_scale`` 2
    is what a gradient twice too large would give)."""
    model = build(kind, seed, tp=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5 * lr_scale, momentum=0.9)
    ids_fn = tw.global_ids if kind == "gpt2" else ids_with_padding
    losses = []
    for step in range(steps):
        ids = ids_fn(step, data_ranks * b)
        per_rank = [loss_of(kind, model, ids[r * b:(r + 1) * b]) for r in range(data_ranks)]
        losses.append([x.item() for x in per_rank])
        torch.stack(per_rank).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# ---- rank bodies ------------------------------------------------------------------------------------
def _introspect(model: Any) -> dict:
    """Every helper's answer, by name, and what the sharding says about each parameter."""
    names = {id(m): n for n, m in model.get_module().named_modules()}
    full = model.state_dict()
    params = dict(model.named_parameters())
    buffers = dict(model.get_module().named_buffers())
    return {
        "modules": sorted(names[id(m)] for m in model.distributed_modules()),
        "distributed": sorted(n for n, p in params.items() if model.is_distributed_parameter(p)),
        "split": sorted(n for n, p in params.items() if p.numel() != full[n].numel()),
        "scaled": sorted(n for n, p in params.items() if model.is_scaled_batch_parameter(p)),
        "default_reducer": sorted(n for n, _ in model.default_reducer_named_parameters()),
        "scaled_reducer": sorted(n for n, _ in model.scaled_batch_reducer_named_parameters()),
        "buffers": {n: (model.is_distributed_buffer(b), model.is_scaled_batch_buffer(b)) for n, b in buffers.items()},
        "scaled_state": sorted(k for k in model.local_state_dict(scaled_batch_only=True) if not k.startswith("_smp")),
        "holders": sorted(names[id(m)] for m in model.get_module().modules()
                          if any(model.is_distributed_parameter(p) for p in m.parameters(recurse=False))),
    }


def _train(model: Any, kind: str, loss_fn: Callable, steps: int, b: int, ids_fn: Callable,
           raw_grads: bool = False) -> dict:
    """SGD through smp (prescaled_batch false: rows by dp_rank); raw gradients of the first backward."""
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    raw: dict[str, torch.Tensor] = {}

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(kind, model, ids)
        model.backward(loss)
        if raw_grads and not raw:  # before any reduction: what this rank's backward produced
            raw.update({n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
        return loss

    losses = []
    for step in range(steps):
        ids = ids_fn(step, smp.dp_size() * b)[smp.dp_rank() * b:(smp.dp_rank() + 1) * b]
        losses.append(train_step(model, ids).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "raw_grads": raw, "data_rank": smp.dp_rank(), "data_ranks": smp.dp_size()}


def run_api(b: int, ckpt_dir: str) -> dict:
    """tp 2 on 2 ranks: the helpers on GPT-2 (sharded in place) and on the user-registered model; the
    vocab-split embedding and the user registrations train like single process; GPT-2's full checkpoint."""
    smp.init({"ddp": True, "tensor_parallel_degree": 2, "tensor_parallel_seed": 3})
    out: dict[str, Any] = {}
    with smp.model_creation(tensor_parallelism=True):
        net = tw.hf_model("gpt2", 21)
    model = smp.DistributedModel(net)
    out["gpt2"] = _introspect(model)
    out["gpt2"].update(_train(model, "gpt2", tw.loss_of, 2, b, tw.global_ids, raw_grads=True))
    smp.save_checkpoint(ckpt_dir, "full", partial=False, model=model)
    for kind, seed in (("user", 22), ("vocab", 23)):
        smp.reset()
        model = smp.DistributedModel(build(kind, seed + 100, tp=True))  # fresh weights, then the reference's
        out[kind] = {"report": dict(vars(model.get_module()._smp2ds_tp_report))}
        model.load_state_dict(build(kind, seed, tp=False).state_dict())
        out[kind].update(_introspect(model))
        out[kind].update(_train(model, kind, loss_of, 3, b, ids_with_padding))
        out[kind]["local"] = {k: tuple(v.shape) for k, v in model.local_state_dict().items()
                              if isinstance(v, torch.Tensor)}
    smp.barrier()
    return plain(out)


def run_load_full_at_tp4(b: int, ckpt_dir: str) -> dict:
    """tp 4 on 4 ranks: GPT-2 with other weights resumes from the full checkpoint written at tp 2."""
    smp.init({"ddp": True, "tensor_parallel_degree": 4})
    with smp.model_creation(tensor_parallelism=True):
        net = tw.hf_model("gpt2", 99)
    model = smp.DistributedModel(net)
    smp.resume_from_checkpoint(ckpt_dir, tag="full", partial=False)
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ids = tw.global_ids(7, 4 * b)[smp.rank() * b:(smp.rank() + 1) * b]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    full = model.state_dict()
    out = {"weights": full, "logits": logits, "ids": ids, "tp": smp.tp_size(),
           "shards": {n: (p.numel(), full[n].numel()) for n, p in model.named_parameters()}}
    smp.barrier()
    return plain(out)


def run_bf16(b: int, steps: int) -> dict:
    """tp 2 with bf16 (DeepSpeed's bf16 optimizer, fp32 master weights): GPT-2 sharded in place."""
    smp.init({"ddp": True, "tensor_parallel_degree": 2, "bf16": True, "microbatches": 2})
    with smp.model_creation(tensor_parallelism=True):
        net = tw.hf_model("gpt2", 31)
    model = smp.DistributedModel(net)
    out = _train(model, "gpt2", loss_of, steps, b, tw.global_ids)
    out["dtype"] = str(next(model.parameters()).dtype)
    out["weights"] = {k: v.float() for k, v in out["weights"].items()}
    smp.barrier()
    return plain(out)


def full_checkpoint(ckpt_dir: str) -> dict:
    return {k: v for k, v in torch.load(os.path.join(ckpt_dir, "full"), weights_only=False).items()
            if not k.startswith("_smp")}
