"""Activations saved for backward per distributed transformer layer: ``optimize: memory`` (sequence
parallelism) against ``optimize: speed`` (hidden states whole on every tensor-parallel rank).

For each layout ``--tp`` ranks (gloo, CPU, ``prescaled_batch: false``: the group joins its batches) build
``smp.nn.DistributedTransformer`` stacks of 1 and ``1 + --layers`` GPT-2-like pre-layernorm layers (dropout
0.1) and count, on rank 0, the bytes autograd saves for backward during forward
(:mod:`smp2ds.engine.diagnostics.saved_activations`); a layer's share is the difference divided by
``--layers``. The bytes split into tensors shaped like the hidden states (layer-norm inputs and
statistics, projection inputs, dropout masks: duplicated on every rank with speed) and the others
(attention scores, head- and feature-split tensors: split by the degree in both layouts). Forward +
backward wall time of the larger stack (median of ``--repeat``) is printed too.

Target: memory / speed per layer <= (other + hidden-shaped / tp) / (other + hidden-shaped) of the speed
layout, i.e. the duplicated part shrinks by at least the degree and nothing else grows.

    python bench/sequence_parallel_memory.py [--tp 2] [--hidden 384] [--heads 6] [--seq 256] [--batch 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch.multiprocessing as mp


def _worker(rank: int, args: argparse.Namespace, optimize: str, rdv: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.tp), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(args.tp), "SMP2DS_INIT_METHOD": rdv, "OMP_NUM_THREADS": "1",
                       "DS_ACCELERATOR": "cpu"})
    import torch

    import smdistributed.modelparallel.torch as smp
    from smp2ds.engine.diagnostics.saved_activations import saved_activations, split_bytes

    smp.init({"ddp": True, "tensor_parallel_degree": args.tp, "optimize": optimize})
    layer = {"num_attention_heads": args.heads, "attention_head_size": args.hidden // args.heads,
             "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "attention_dropout_prob": 0.1,
             "hidden_dropout_prob": 0.1, "causal_mask_size": args.seq, "pre_layernorm": True,
             "post_layernorm": False}
    hidden = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(rank),
                         requires_grad=True)
    parts, times = [], []
    for layers in (1, 1 + args.layers):
        torch.manual_seed(0)
        stack = smp.nn.DistributedTransformer(num_layers=layers, **layer).train()
        saved, _ = saved_activations(lambda s=stack: s((hidden, None))[0], stack.parameters())
        parts.append(split_bytes(saved, args.hidden))
    for _ in range(args.repeat):
        start = time.perf_counter()
        stack((hidden, None))[0].square().mean().backward()
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"hidden_shaped": (parts[1][0] - parts[0][0]) / args.layers,
                       "other": (parts[1][1] - parts[0][1]) / args.layers, "seconds": statistics.median(times)}, f)
    smp.barrier()


def _measure(args: argparse.Namespace, optimize: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(args, optimize, f"file://{tmp}/rdv", out), nprocs=args.tp, join=True)
        with open(out) as f:
            return json.load(f)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    clash = {args.seq, args.hidden // args.heads, 4 * args.hidden // args.tp, 1} & {args.hidden}
    if clash:  # the split into hidden-shaped and other tensors goes by the last dimension
        parser.error(f"--hidden {args.hidden} must differ from --seq, the head size and 4 x hidden / tp")
    got = {optimize: _measure(args, optimize) for optimize in ("speed", "memory")}
    print(f"tp {args.tp}, batch {args.batch} per rank (x{args.tp} joined) x seq {args.seq}, hidden {args.hidden}, "
          f"{args.heads} heads; saved for backward per layer on rank 0:")
    total = {}
    for name, r in got.items():
        total[name] = r["hidden_shaped"] + r["other"]
        print(f"{name:>7}: {total[name] / 2**20:7.2f} MiB (hidden-shaped {r['hidden_shaped'] / 2**20:6.2f} MiB, "
              f"other {r['other'] / 2**20:6.2f} MiB); forward+backward {r['seconds'] * 1e3:7.1f} ms")
    speed = got["speed"]
    target = (speed["other"] + speed["hidden_shaped"] / args.tp) / total["speed"]
    ratio = total["memory"] / total["speed"]
    ok = ratio <= target + 1e-9
    print(f"memory / speed saved bytes per layer: {ratio:.3f} (target <= {target:.3f}); hidden-shaped part "
          f"{got['memory']['hidden_shaped'] / speed['hidden_shaped']:.3f}; time memory / speed "
          f"{got['memory']['seconds'] / speed['seconds']:.2f} {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
