"""A SageMaker model parallel (SMP v1) training script, unchanged, running on smp2ds.

Written the way SMP v1 scripts were (smp.init, DistributedModel, DistributedOptimizer,
@smp.step with model.backward, StepOutput.reduce_mean, smp.save_checkpoint,
smp.resume_from_checkpoint); the SMP configuration comes from the launcher through
SM_HP_MP_PARAMETERS, e.g.

    SM_HP_MP_PARAMETERS='{"ddp": true, "microbatches": 2, "shard_optimizer_state": true}' \
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_smp_mlp.py

The data are synthetic and deterministic, so every launcher prints the same losses and final
weights. Rank 0 prints the loss per step, the plan smp2ds ran, and a digest of the weights.
"""

import argparse
import hashlib
import json

import torch
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    parser.add_argument("--checkpoint-dir", default=None, help="save a partial checkpoint there after the last step")
    parser.add_argument("--resume-dir", default=None, help="resume from the newest checkpoint there (its steps "
                        "count: --steps more are run)")
    parser.add_argument("--dump-weights", default=None, help="rank 0 saves the final weights here (torch.save)")
    parser.add_argument("--quiet", action="store_true")
    args, _ = parser.parse_known_args()  # SageMaker also passes --mp_parameters ...; ignore extras
    return args


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def dataset(n=512):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:8].prod(dim=1, keepdim=True)).tanh()
    return x, y


def main():
    args = parse_args()
    smp.init()
    torch.manual_seed(0)
    model = smp.DistributedModel(make_model())
    opt_cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    optimizer = smp.DistributedOptimizer(opt_cls(model.parameters(), lr=args.lr))

    @smp.step
    def train_step(model, data, target):
        loss = F.mse_loss(model(data), target)
        model.backward(loss)
        return loss

    x, y = dataset()
    b, dp = args.batch_size, smp.dp_size()
    if smp.rank() == 0 and not args.quiet:
        plan = getattr(smp.state.cfg, "plan", None)  # smp2ds extension: the plan this run follows
        if plan is not None:
            print("plan.topology:", json.dumps({k: v for k, v in plan.topology.items() if k != "groups"}))
            print("plan.deepspeed:", json.dumps(plan.deepspeed, sort_keys=True))
    first = 0
    if args.resume_dir:
        first = smp.resume_from_checkpoint(args.resume_dir)["steps"]  # the newest partial checkpoint
    loss = None
    for step in range(first, first + args.steps):
        start = (step * b * dp) % x.shape[0] + smp.dp_rank() * b  # shard each global batch by dp_rank
        data, target = x[start:start + b], y[start:start + b]
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, data, target).reduce_mean()
        optimizer.step()
        # average the loss over data-parallel ranks for logging
        losses = smp.allgather(loss.item(), smp.DP_GROUP)
        if smp.rank() == 0 and not args.quiet:
            print(f"step {step} loss {sum(losses) / len(losses):.6f}")

    if args.checkpoint_dir:
        smp.save_checkpoint(args.checkpoint_dir, tag=f"step{first + args.steps}", partial=True, model=model,
                            optimizer=optimizer, user_content={"steps": first + args.steps})
    state = model.state_dict()
    if smp.rank() == 0:
        flat = torch.cat([state[k].float().reshape(-1) for k in sorted(state)])
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        print(f"final weights sha256 {digest} sum {flat.sum().item():.8f}")
        if args.dump_weights:
            torch.save({k: v.float() for k, v in state.items()}, args.dump_weights)
    smp.barrier()


if __name__ == "__main__":
    main()
