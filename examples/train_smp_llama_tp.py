"""An SMP v1 tensor-parallel training script for a tiny LLaMA, unchanged, running on smp2ds.

Written the way SMP's Hugging Face examples were (smp.init, the model built inside
smp.model_creation(tensor_parallelism=True), DistributedModel, DistributedOptimizer, @smp.step with
model.backward); the SMP configuration comes from the launcher through SM_HP_MP_PARAMETERS, e.g.

    SM_HP_MP_PARAMETERS='{"ddp": true, "tensor_parallel_degree": 2}' \
    DS_ACCELERATOR=cpu torchrun --nproc-per-node 2 examples/train_smp_llama_tp.py

The model is built from a config (no download) and the tokens are synthetic and deterministic. Every rank of a
tensor-parallel group reads the same rows (the batch is chosen by rdp_rank, the data-parallel rank without
tensor parallelism), which is also what DeepSpeed's AutoTP asks of a ported script. Rank 0 prints the loss per
step, the last loss averaged over the data-parallel replicas with torch.distributed on SMP's process groups, and a
digest of the full (gathered) weights, in the format of examples/train_smp_mlp.py.
"""

import argparse
import hashlib

import torch
import torch.distributed
from transformers import LlamaConfig, LlamaForCausalLM

import smdistributed.modelparallel.torch as smp

VOCAB = 128


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4, help="per data-parallel group")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dump-weights", default=None, help="rank 0 saves the final weights here (torch.save)")
    parser.add_argument("--quiet", action="store_true")
    args, _ = parser.parse_known_args()  # SageMaker also passes --mp_parameters ...; ignore extras
    return args


def llama_config():
    # 4 heads and 4 key-value heads: tensor-parallel degrees 1, 2 and 4 divide them
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       tie_word_embeddings=False)


def dataset(n, seq_len):
    # arithmetic token sequences (a start and a stride per row): a pattern the model can learn
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % VOCAB


def main():
    args = parse_args()
    smp.init()
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        model = LlamaForCausalLM(llama_config())
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=args.lr))

    @smp.step
    def train_step(model, input_ids):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        model.backward(loss)
        return loss

    tokens = dataset(256, args.seq_len)
    b, rdp = args.batch_size, smp.rdp_size()
    loss = None
    for step in range(args.steps):
        start = (step * b * rdp) % tokens.shape[0] + smp.rdp_rank() * b  # same rows on a tensor-parallel group
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, tokens[start:start + b]).reduce_mean()
        optimizer.step()
        losses = smp.allgather(loss.item(), smp.DP_GROUP)
        if smp.rank() == 0 and not args.quiet:
            print(f"step {step} loss {sum(losses) / len(losses):.6f}")

    # the replicas' mean of the last loss over SMP's reduced-data-parallel group; the tensor-parallel group's ranks
    # counted over its own group
    last = loss.detach().clone()
    torch.distributed.all_reduce(last, group=smp.get_rdp_process_group())
    ranks = torch.ones(())
    torch.distributed.all_reduce(ranks, group=smp.get_tp_process_group())
    if smp.rank() == 0 and not args.quiet:
        print(f"replicas' last loss {last.item() / smp.rdp_size():.6f} over {int(ranks.item())} tensor-parallel ranks")
    state = model.state_dict()  # the full model on every rank: tensor-parallel shards gathered
    if smp.rank() == 0:
        flat = torch.cat([state[k].float().reshape(-1) for k in sorted(state)])
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        print(f"final weights sha256 {digest} sum {flat.sum().item():.8f}")
        if args.dump_weights:
            torch.save({k: v.float() for k, v in state.items()}, args.dump_weights)
    smp.barrier()


if __name__ == "__main__":
    main()
