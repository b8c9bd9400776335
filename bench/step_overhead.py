"""Step-time overhead of ``smp.step`` + ``DistributedModel`` over a hand-written DeepSpeed loop.

Both train the same MLP on the same data with the same layout, in the same processes, in
interleaved rounds (so machine noise hits both alike):

* SMP: ``@smp.step`` function calling ``model(x)`` and ``model.backward(loss)`` over
  ``microbatches`` micro-batches, then ``optimizer.step()``;
* DeepSpeed: ``engine(x_i)``, ``engine.backward(loss)``, ``engine.step()`` per micro-batch with
  ``gradient_accumulation_steps = microbatches`` (DeepSpeed's own accumulation).

Prints the median step time of each and their ratio (target <= 1.05). Usage:
``python bench/step_overhead.py [--world 2] [--microbatches 2] [--zero 1] [--rounds 6 --steps 10]``.
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


def _model(hidden: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def _worker(rank: int, args: argparse.Namespace, rdv: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(args.world), "SMP2DS_INIT_METHOD": rdv, "OMP_NUM_THREADS": "1",
                       "DS_ACCELERATOR": "cpu"})
    import deepspeed
    import torch
    import torch.nn.functional as F

    import smdistributed.modelparallel.torch as smp

    m = args.microbatches
    smp.init({"ddp": True, "microbatches": m, "shard_optimizer_state": args.zero == 1})
    model = smp.DistributedModel(_model(args.hidden))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    ds_cfg = {"train_micro_batch_size_per_gpu": args.batch // m, "gradient_accumulation_steps": m,
              "zero_optimization": {"stage": args.zero}, "gradient_clipping": 0.0, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True}
    ds_model = _model(args.hidden)
    engine, *_ = deepspeed.initialize(model=ds_model, optimizer=torch.optim.Adam(ds_model.parameters(), lr=1e-3),
                                      config=ds_cfg)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 256, generator=g), torch.randn(args.batch, 1, generator=g)

    def smp_step() -> None:
        opt.zero_grad()
        train_step(model, x, y).reduce_mean()
        opt.step()

    def ds_step() -> None:
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            loss = F.mse_loss(engine(xm), ym)
            engine.backward(loss)
            engine.step()

    times: dict[str, list[float]] = {"smp": [], "deepspeed": []}
    for fn in (smp_step, ds_step):  # warm-up
        for _ in range(3):
            fn()
    for _ in range(args.rounds):
        for name, fn in (("smp", smp_step), ("deepspeed", ds_step)):
            smp.barrier()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(times, handle)
    smp.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--zero", type=int, choices=[0, 1], default=1, help="1 = shard_optimizer_state")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="smp2ds-bench-") as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_worker, args=(args, f"file://{tmp}/rdv", out), nprocs=args.world, start_method="spawn")
        with open(out) as handle:
            times = json.load(handle)
    smp_ms = statistics.median(times["smp"]) * 1e3
    ds_ms = statistics.median(times["deepspeed"]) * 1e3
    print(f"layout: {args.world} ranks, microbatches {args.microbatches}, ZeRO stage {args.zero}, "
          f"MLP 256-{args.hidden}-{args.hidden}-1, batch {args.batch} per rank, "
          f"{args.rounds}x{args.steps} steps each, interleaved")
    print(f"smp.step + DistributedModel: median {smp_ms:.2f} ms/step")
    print(f"hand-written DeepSpeed loop: median {ds_ms:.2f} ms/step")
    print(f"ratio smp / deepspeed = {smp_ms / ds_ms:.3f} (target <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
