"""GPT-2 pre-training with tensor parallelism, written the way SMP's GPT-2 example scripts were.

smp.init with a config dict built from arguments (``tensor_parallel_degree``, ``prescaled_batch``,
``microbatches``), a Hugging Face model built from its config inside
``smp.model_creation(tensor_parallelism=True, dtype=...)`` (sharded in place, Hugging Face names kept),
parameter groups split by weight decay, ``smp.DistributedModel`` / ``smp.DistributedOptimizer``, an
``@smp.step`` function with ``model.backward``, ``clip_master_grads``, and the data sharded by
``dp_rank`` (or ``rdp_rank`` with ``prescaled_batch``), as ``smp.state.cfg.prescaled_batch`` says.
Synthetic tokens (no dataset download). Saves a full checkpoint on every rank (SMP gathers it; rank 0
writes) and each rank writes ``$SMP2DS_SCRIPT_OUT/rank<N>.json``.
"""

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, GPT2Config, set_seed

import smdistributed.modelparallel.torch as smp

VOCAB, SEQ = 64, 16


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--train-batch-size", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--tensor-parallel-degree", type=int, default=2)
    parser.add_argument("--pipeline-parallel-degree", type=int, default=1)
    parser.add_argument("--prescaled-batch", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--grad-clip", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--checkpoint-dir", default=None)
    return parser.parse_args()


def model_config():
    return GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)


def tokens(steps, global_batch, seed=2024):
    return torch.randint(0, VOCAB, (steps, global_batch, SEQ), generator=torch.Generator().manual_seed(seed))


def get_param_groups_by_weight_decay(module, weight_decay):
    decay, no_decay, seen = [], [], set()
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            (no_decay if name == "bias" or isinstance(sub, torch.nn.LayerNorm) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@smp.step
def train_step(model, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def main():
    args = parse_args()
    smp.init({
        "ddp": True,
        "microbatches": args.microbatches,
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "prescaled_batch": args.prescaled_batch > 0,
        "optimize": "speed",
    })
    set_seed(args.seed)
    # No distributed-transformer settings (fused_softmax, attention_in_fp32, ...): the Hugging Face model is
    # sharded in place and keeps its names (with them, smp2ds swaps in SMP's DistributedTransformerLMHead).
    with smp.model_creation(tensor_parallelism=True, dtype=torch.get_default_dtype()):
        model = AutoModelForCausalLM.from_config(model_config())
    model = smp.DistributedModel(model, trace_device="gpu")
    groups = get_param_groups_by_weight_decay(model.get_module(), args.weight_decay)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-6))

    if smp.state.cfg.prescaled_batch:
        rank, size = smp.rdp_rank(), smp.rdp_size()
    else:
        rank, size = smp.dp_rank(), smp.dp_size()
    data = tokens(args.steps, args.train_batch_size * size)
    rows = slice(rank * args.train_batch_size, (rank + 1) * args.train_batch_size)
    losses, grad_norms = [], []
    model.train()
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, data[step, rows]).reduce_mean()
        grad_norms.append(float(optimizer.clip_master_grads(args.grad_clip)))
        optimizer.step()
        losses.append(loss.item())
    if args.checkpoint_dir:
        smp.save_checkpoint(args.checkpoint_dir, tag="full", partial=False, model=model)
    local_numel = {n: p.numel() for n, p in model.named_parameters()}
    weights = {k: v.float().flatten().tolist() for k, v in model.state_dict().items()}
    report = {"rank": smp.rank(), "data_rank": rank, "data_ranks": size, "losses": losses, "grad_norms": grad_norms,
              "tp": [smp.tp_rank(), smp.tp_size()], "pp": [smp.pp_rank(), smp.pp_size()], "local_numel": local_numel,
              "full_numel": {k: len(v) for k, v in weights.items()}, "weights": weights}
    with open(os.path.join(os.environ["SMP2DS_SCRIPT_OUT"], f"rank{smp.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
