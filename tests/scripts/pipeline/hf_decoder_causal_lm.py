"""An SMP GPT-example-style pipeline script for a Hugging Face decoder without a named layer list.

As SMP's GPT example: ``smp.init()``, ``AutoModelForCausalLM.from_config`` (a tiny Qwen3 config:
no downloads), ``smp.DistributedModel``, ``smp.DistributedOptimizer`` around AdamW, an
``@smp.step`` that returns ``model(..., labels=input_ids)["loss"]`` after ``model.backward``.
Before that it wraps a ``FalconForCausalLM`` with ``alibi=True`` (ALiBi biases built per call: not
cut by structure) and records the refusal ``smp.DistributedModel`` raises. Writes
``rank<N>.json`` into ``$SMP2DS_SCRIPT_OUT``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, FalconConfig, FalconForCausalLM, Qwen3Config

import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.exceptions import SMPUnsupportedError

PER_RANK, SEQ, VOCAB = 4, 8, 64


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                         pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def make_optimizer(params) -> torch.optim.Optimizer:
    # eps 1e-6: see tests/engine/pipeline/test_pipeline_hf_decoders_dist.py (rounding noise in zero gradients)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6)


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    ids = torch.randint(1, VOCAB, (dp * PER_RANK, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, SEQ - 3:] = 0  # some padding
    return ids, mask


@smp.step
def train_step(model, input_ids, attention_mask):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def refusal() -> str:
    """What ``smp.DistributedModel`` says about a model the structural cut cannot follow."""
    falcon = FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, alibi=True))
    try:
        smp.DistributedModel(falcon)
    except SMPUnsupportedError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    smp.init()
    refused = refusal()
    model = smp.DistributedModel(make_model())
    optimizer = smp.DistributedOptimizer(make_optimizer(model.parameters()))
    losses = []
    for step in range(args.steps):
        ids, mask = global_batch(step, smp.dp_size())
        rows = slice(smp.dp_rank() * PER_RANK, (smp.dp_rank() + 1) * PER_RANK)
        optimizer.zero_grad()
        loss_mb = train_step(model, ids[rows], mask[rows])
        optimizer.step()
        losses.append([float(x) for x in loss_mb.outputs])
    state = model.state_dict()
    result = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "dp_rank": smp.dp_rank(), "losses": losses,
              "refused": refused, "state": {k: v.tolist() for k, v in state.items()}}
    with open(os.path.join(os.environ["SMP2DS_SCRIPT_OUT"], f"rank{smp.rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
