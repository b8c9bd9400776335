"""Rank bodies for the ``optimize: memory`` (sequence-parallel) tests and bench.

``run`` trains freshly replaced Hugging Face models through :mod:`tests.engine.workers.transformer_workers` (the
reference there is single-process Hugging Face training) and measures one distributed transformer
layer's saved activations (:mod:`smp2ds.engine.diagnostics.saved_activations`: each storage autograd keeps
for backward once, parameters not at all).
"""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.diagnostics.saved_activations import saved_activations
from tests.engine.workers import transformer_workers as tw
from tests.engine.workers.train_workers import plain

LAYER = {"num_attention_heads": 4, "attention_head_size": 8, "hidden_size": 32, "intermediate_size": 128,
         "attention_dropout_prob": 0.1, "hidden_dropout_prob": 0.1, "causal_mask_size": 16,
         "pre_layernorm": True, "post_layernorm": False}
"""A GPT-2-like pre-layernorm layer (dropout on, so masks are among the saved tensors)."""


def measure(smp: Any, n: int, seq: int, layers: int = 1) -> dict:
    """Saved activations (``saved``: ``(shape, bytes)`` per storage) of ``smp.nn.DistributedTransformer``
    (``layers`` x ``LAYER``) on this rank's ``[n, seq, hidden]`` batch, and its output
    shape (the running config picks speed or memory)."""
    torch.manual_seed(0)
    module = smp.nn.DistributedTransformer(num_layers=layers, **LAYER)
    module.train()
    hidden = torch.randn(n, seq, LAYER["hidden_size"], generator=torch.Generator().manual_seed(smp.rank()),
                         requires_grad=True)
    saved, out = saved_activations(lambda: module((hidden, None))[0], module.parameters())
    out.float().square().mean().backward()
    return {"saved": saved, "out_shape": tuple(out.shape)}


def refusal(smp: Any, seq: int) -> str:
    """The message a sequence length not divisible by the degree gets (memory layout)."""
    module = smp.nn.DistributedTransformer(num_layers=1, **LAYER)
    try:
        module((torch.randn(2, seq, LAYER["hidden_size"]), None))
    except Exception as exc:  # noqa: BLE001 - the message goes to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def dropout_masks(smp: Any) -> dict:
    """Sequence-split dropout drawn twice from the same state of the group's stream (as a checkpoint
    recomputation does)."""
    from smp2ds.engine.nn import sequence_parallel as seq
    from smp2ds.engine.nn.parallel import context

    drop, x, tp = torch.nn.Dropout(0.5), torch.ones(2, 8, 16), context.installed().tp
    with tp.rng.region_stream():
        state = torch.get_rng_state()
        first = seq.dropout(drop, x, True, tp)
        torch.set_rng_state(state)
        again = seq.dropout(drop, x, True, tp)
    return {"first": first, "again": again}


def collective_pairs(smp: Any) -> dict:
    """``gather_sequence`` (all-gather / reduce-scatter) and ``reduce_scatter_sequence`` (the reverse) on
    rank-dependent tensors, with the gradients of a weighted sum (weights equal on every rank)."""
    from smp2ds.engine.diagnostics import comm_counter
    from smp2ds.engine.nn.parallel import context
    from smp2ds.engine.nn.parallel.collectives import gather_sequence, reduce_scatter_sequence

    tp, weight = context.installed().tp, torch.arange(48.0).reshape(2, 8, 3)
    mine = torch.full((2, 4, 3), float(smp.rank() + 1), requires_grad=True)
    joined = gather_sequence(mine, tp)
    (joined * weight).sum().backward()
    whole = (torch.arange(48.0).reshape(2, 8, 3) * (smp.rank() + 1)).requires_grad_()
    with comm_counter.CommCounter() as counter:
        part = reduce_scatter_sequence(whole, tp)
    (part * weight[:, tp.rank * 4:(tp.rank + 1) * 4]).sum().backward()
    return {"joined": joined.detach(), "gather_grad": mine.grad, "part": part.detach(), "scatter_grad": whole.grad,
            "scatter_ops": [(r.op, r.nbytes) for r in counter.records]}


DIRECT = {
    "gpt2_vocab_parallel": {"pre_layernorm": True, "post_layernorm": False, "causal_mask_size": 16,
                            "distribute_embedding": True},
    "bert_fp32_residual": {"num_token_types": 2, "fp32_residual_addition": True, "use_lm_head_bias": True},
}
"""``smp.nn.DistributedTransformerLMHead`` settings trained directly (dropout 0) in both layouts."""


def direct(smp: Any) -> dict:
    """Loss and this rank's gradients of one step of each ``DIRECT`` model (fresh weights, same data)."""
    out = {}
    for name, settings in DIRECT.items():
        model = smp.nn.DistributedTransformerLMHead(
            num_layers=2, num_attention_heads=4, attention_head_size=4, hidden_size=16, intermediate_size=64,
            vocab_size=tw.VOCAB, num_positions=16, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
            embedding_dropout_prob=0.0, **settings)
        ids, mask = tw.batch(50 + smp.rank(), 2)
        token_types = (ids % 2) if settings.get("num_token_types") else None
        loss, _ = model((ids, 1 - mask, token_types, None, tw.labels_of(ids, mask)))
        loss.backward()
        out[name] = {"loss": loss.detach(), "grads": {k: p.grad for k, p in model.named_parameters()}}
    return out


def run(config: dict, phases: list[dict], b: int, n: int = 2, seq: int = 16) -> dict:
    """Train ``phases`` (transformer_workers), then measure saved activations and the refusal."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    first = direct(smp)  # before anything else draws fresh weights: both layouts build the same models
    results = []
    for phase in phases:
        smp.reset()
        results.append(tw._train(smp, phase, b))
    smp.reset()
    out = {"phases": results, "direct": first, "optimize": smp.state.plan.engine["tensor_parallel"]["optimize"],
           "one_layer": measure(smp, n, seq, 1), "two_layers": measure(smp, n, seq, 2),
           "refusal": refusal(smp, seq - 1), "dropout": dropout_masks(smp),
           "collectives": collective_pairs(smp)}
    smp.barrier()
    return plain(out)


def pipeline_run(config: dict, phase: dict, b: int) -> dict:
    """Train a replaced Hugging Face model with pipeline stages (the model runs only inside ``@smp.step``):
    losses and full weights under Hugging Face names, as :func:`tests.engine.workers.transformer_workers._train`,
    and the shapes of the tensors autograd saved during the steps."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    with smp.model_creation(tensor_parallelism=True, **tw.SETTINGS):
        net = tw.hf_of(phase)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(tw.make_optimizer(phase["optimizer"], model.parameters()))
    rank, ranks = smp.dp_rank(), smp.dp_size()
    mine = slice(rank * b, (rank + 1) * b)

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, attention_mask=mask, labels=tw.labels_of(ids, mask))["loss"]
        model.backward(loss)
        return loss

    losses, saved = [], []
    for step in range(phase["steps"]):
        ids, mask = tw.batch(step, ranks * b)
        shapes, out = saved_activations(lambda i=ids, m=mask: train_step(model, i[mine], m[mine]), model.parameters())
        saved += [shape for shape, _ in shapes]
        losses.append(out.reduce_mean().item())
        opt.step()
        opt.zero_grad()
    weights = {k: v.clone() for k, v in tw.to_hf_names(phase, model.state_dict()).items()}
    smp.barrier()
    return plain({"losses": losses, "weights": weights, "data_rank": rank, "data_ranks": ranks, "saved": saved})


def micro_reference(phase: dict, ranks: int, b: int, micro: int) -> dict:
    """Single-process Hugging Face training where each rank's loss is the mean of its ``micro``
    micro-batches' losses (what a pipelined ``@smp.step`` returns) and the step averages the ranks."""
    model = tw.hf_of(phase)
    opt = tw.make_optimizer(phase["optimizer"], model.parameters())
    rows, losses = b // micro, []
    for step in range(phase["steps"]):
        ids, mask = tw.batch(step, ranks * b)
        labels = tw.labels_of(ids, mask)
        per_rank = [torch.stack([model(input_ids=ids[s], attention_mask=mask[s], labels=labels[s]).loss
                                 for s in (slice(r * b + m * rows, r * b + (m + 1) * rows) for m in range(micro))]
                                ).mean() for r in range(ranks)]
        losses.append([x.item() for x in per_rank])
        torch.stack(per_rank).mean().backward()
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}
