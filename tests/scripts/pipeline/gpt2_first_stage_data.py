"""An SMP GPT-2 pre-training-style pipeline script, run unchanged by the script tests.

As SMP's GPT-2 scripts: a Hugging Face ``GPT2LMHeadModel`` (tiny config, built from a config: no
downloads) in ``smp.DistributedModel``, an ``@smp.step`` that takes the model, the optimizer and
the batch and returns ``model(..., labels=input_ids)["loss"]``; token batches are loaded on
``pp_rank 0`` only, the other stages pass empty tensors. Writes ``rank<N>.json`` into
``$SMP2DS_SCRIPT_OUT``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import smdistributed.modelparallel.torch as smp

PER_RANK, SEQ, VOCAB = 4, 8, 64


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (dp * PER_RANK, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::2, SEQ - 2:] = 0  # some padding
    return ids, mask


@smp.step
def train_step(model, optimizer, input_ids, attention_mask):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    smp.init()
    model = smp.DistributedModel(make_model())
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for step in range(args.steps):
        if smp.pp_rank() == 0:
            ids, mask = global_batch(step, smp.dp_size())
            rows = slice(smp.dp_rank() * PER_RANK, (smp.dp_rank() + 1) * PER_RANK)
            input_ids, attention_mask = ids[rows], mask[rows]
        else:
            input_ids = attention_mask = torch.empty(0, dtype=torch.long)
        optimizer.zero_grad()
        loss_mb = train_step(model, optimizer, input_ids, attention_mask)
        optimizer.step()
        losses.append([float(x) for x in loss_mb.outputs])
    state = model.state_dict()
    result = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "dp_rank": smp.dp_rank(), "losses": losses,
              "state": {k: v.tolist() for k, v in state.items()}}
    with open(os.path.join(os.environ["SMP2DS_SCRIPT_OUT"], f"rank{smp.rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
