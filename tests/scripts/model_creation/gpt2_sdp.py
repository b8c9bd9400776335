"""GPT-2 pre-training with sharded data parallelism, written the way SMP's GPT-2 example scripts were.

smp.init with a config dict built from arguments, a Hugging Face model built from its config (or, to
fine-tune, loaded with ``from_pretrained``) inside ``smp.model_creation(...)`` (transformers imports the
model code lazily, there), parameter groups
split by weight decay, ``smp.DistributedModel`` / ``smp.DistributedOptimizer``, an ``@smp.step``
function with ``model.backward``, ``optimizer.step()`` at the accumulation boundary, SDP clipping
through ``sdp_gradient_clipping``, and the ZeRO optimizer's state read through the
DistributedOptimizer (``fp32_partitioned_groups_flat``, ``_global_grad_norm``), as the example's
``sdp_utils`` and logging do. Synthetic tokens (no dataset download).

Each rank writes ``$SMP2DS_SCRIPT_OUT/rank<N>.json``: losses, grad norms, what it saw of the
partitioned parameters, and the final full weights.
"""

import argparse
import json
import math
import os
import warnings

import torch
from transformers import AutoModelForCausalLM, GPT2Config, set_seed

import smdistributed.modelparallel.torch as smp

VOCAB, SEQ = 64, 16


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--train-batch-size", type=int, default=4, help="per data-parallel rank")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--sharded-data-parallel-degree", type=int, default=2)
    parser.add_argument("--delayed-param", type=int, default=1)
    parser.add_argument("--zero-init", choices=["default", "true", "false"], default="true")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--fine-tune", type=int, default=0)
    parser.add_argument("--model-dir", default=None, help="a save_pretrained folder to fine-tune from")
    return parser.parse_args()


def model_config():
    return GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)


def tokens(steps, global_batch, seed=2024):
    """The whole job's token batches: [steps, global_batch, SEQ]; data-parallel rank r reads its rows."""
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


def make_optimizer(name, groups, lr):
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


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
        "sharded_data_parallel_degree": args.sharded_data_parallel_degree,
        "delayed_parameter_initialization": args.delayed_param > 0,
        "sdp_gradient_clipping": args.grad_clip,
        "sdp_param_persistence_threshold": 0,
        "sdp_hierarchical_allgather": False,
    })
    set_seed(args.seed)
    zero_init = {"default": None, "true": True, "false": False}[args.zero_init]
    with smp.model_creation(tensor_parallelism=False, zero_init=zero_init, dtype=torch.get_default_dtype(),
                            distribute_embedding=False, fused_softmax=True, fused_bias_gelu=False):
        if args.fine_tune > 0 and args.delayed_param == 0:
            model = AutoModelForCausalLM.from_pretrained(args.model_dir)
        else:
            model = AutoModelForCausalLM.from_config(model_config())
    born_partitioned = all(hasattr(p, "ds_tensor") for p in model.parameters())

    # A dtype other than the training precision cannot be honoured for partitioned creation.
    try:
        with smp.model_creation(zero_init=True, dtype=torch.bfloat16):
            pass
        dtype_refusal = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        dtype_refusal = f"{type(exc).__name__}: {exc}"

    model = smp.DistributedModel(model, trace_device="gpu")
    after_wrap = all(hasattr(p, "ds_tensor") for p in model.parameters())
    groups = get_param_groups_by_weight_decay(model.get_module(), args.weight_decay)
    optimizer = smp.DistributedOptimizer(make_optimizer(args.optimizer, groups, args.lr))
    # sdp_utils.build_param_id_to_buffer in SMP's example reads the ZeRO optimizer's fp32 partitions.
    flat_numel = [int(t.numel()) for t in optimizer.fp32_partitioned_groups_flat]
    partition_numel = sum(int(p.ds_tensor.numel()) for p in model.parameters())

    data = tokens(args.steps, args.train_batch_size * smp.dp_size())
    rows = slice(smp.dp_rank() * args.train_batch_size, (smp.dp_rank() + 1) * args.train_batch_size)
    losses, grad_norms, clip_returns = [], [], []
    model.train()
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, data[step, rows]).reduce_mean()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            clip_returns.append(optimizer.clip_master_grads(args.grad_clip * 10))  # no-op under sdp, as in SMP
        optimizer.step()
        losses.append(loss.item())
        grad_norms.append(float(optimizer._global_grad_norm))

    weights = {k: v.float().flatten().tolist() for k, v in model.state_dict().items()}
    report = {
        "rank": smp.rank(), "dp_rank": smp.dp_rank(), "losses": losses, "grad_norms": grad_norms,
        "ln_vocab": math.log(VOCAB), "born_partitioned": born_partitioned, "partitioned_after_wrap": after_wrap,
        "fp32_flat_numel": flat_numel, "param_partition_numel": partition_numel,
        "param_full_numel": sum(int(p.ds_numel) for p in model.parameters()),
        "shard": [smp.param_shard_rank(), smp.param_shard_size()],
        "clip_master_grads_returned_none": [r is None for r in clip_returns], "dtype_refusal": dtype_refusal,
        "weights": weights,
    }
    with open(os.path.join(os.environ["SMP2DS_SCRIPT_OUT"], f"rank{smp.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
