"""A script whose model builder imports transformers itself, called inside smp.delay_param_initialization().

The first import of transformers (and, through it, of torch._dynamo) then happens while parameters
are being created partitioned. Each rank writes ``$SMP2DS_SCRIPT_OUT/rank<N>.json`` with the full
initial weights read back through ``DistributedModel.state_dict()`` (before the optimizer exists), the
loss of one SGD step on synthetic tokens, and the weights after it.
"""

import json
import os
import sys

import torch

import smdistributed.modelparallel.torch as smp


def build_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def tokens():
    """[ranks, batch, sequence] token ids; data-parallel rank r trains on row r."""
    return torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(5))


def main():
    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "delayed_parameter_initialization": True})
    transformers_before = "transformers" in sys.modules
    torch.manual_seed(0)
    with smp.delay_param_initialization():
        module = build_model()
    partitioned = all(hasattr(p, "ds_tensor") for p in module.parameters())
    model = smp.DistributedModel(module)
    weights = {k: v.float().flatten().tolist() for k, v in model.state_dict().items()}
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    @smp.step
    def train_step(model, input_ids):
        loss = model(input_ids=input_ids, labels=input_ids)["loss"]
        model.backward(loss)
        return loss

    ids = tokens()[smp.dp_rank()]
    optimizer.zero_grad()
    loss = train_step(model, ids).reduce_mean().item()
    optimizer.step()
    trained = {k: v.float().flatten().tolist() for k, v in model.state_dict().items()}
    report = {"transformers_imported_before": transformers_before, "partitioned": partitioned, "weights": weights,
              "loss": loss, "trained": trained}
    with open(os.path.join(os.environ["SMP2DS_SCRIPT_OUT"], f"rank{smp.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
