"""Tensor parallelism: tp 2 x dp 2 step time vs the ideal derived from tp 2 alone.

The same GPT-2, built inside ``smp.model_creation(tensor_parallelism=True)`` and trained through the
real SMP API (``smp.init``, ``smp.DistributedModel``, ``smp.DistributedOptimizer``, ``@smp.step``),
runs as

* ``tp2``: ``tensor_parallel_degree 2`` on 2 ranks (the baseline);
* ``tp2xdp2``: ``tensor_parallel_degree 2`` with ``ddp`` on 4 ranks (2 data-parallel replicas).

Every rank gets the same per-rank batch in both (weak scaling), so a rank's work is the same and
data parallelism only adds the gradient all-reduce across replicas. The two are launched in
alternation (``--rounds`` times each; gloo, CPU, one thread per rank); a step's time is the slowest
rank's, from a barrier to the end of ``optimizer.step()``; medians over all measured steps.

* wall ratio = T(tp2xdp2) / ideal, ideal = T(tp2) x f, f = (4 / min(4, cpus)) / (2 / min(2, cpus)):
  twice the work shares the same cores when there are fewer than 4 (f = 2 on 2 CPUs, 1 on >= 4).
  Target <= 1.1.
* CPU ratio = CPU seconds per rank and step (process time, gloo threads included), tp2xdp2 / tp2:
  the same comparison without the scheduler's say, so other jobs on the machine barely move it.

    python bench/tp_step_time.py [--rounds 1] [--steps 8] [--layers 2] [--hidden 256] [--seq 64] [--batch 8]
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

TARGET = 1.1


def _worker(rank: int, world: int, args: argparse.Namespace, rdv: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "SMP2DS_INIT_METHOD": rdv, "OMP_NUM_THREADS": "1",
                       "DS_ACCELERATOR": "cpu", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    import torch
    import transformers as tf

    import smdistributed.modelparallel.torch as smp

    torch.set_num_threads(1)
    smp.init({"ddp": True, "tensor_parallel_degree": 2, "microbatches": 1})
    cfg = tf.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=4, vocab_size=args.vocab,
                        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        net = tf.GPT2LMHeadModel(cfg)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

    @smp.step
    def train_step(model, ids):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        return loss

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(smp.dp_rank()))
    wall, cpu = [], []
    for step in range(args.warmup + args.steps):
        smp.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        train_step(model, ids)
        opt.step()
        if step >= args.warmup:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    with open(f"{out}.{rank}", "w") as handle:
        json.dump({"wall": wall, "cpu": cpu, "tp": smp.tp_size(), "rdp": smp.rdp_size()}, handle)
    smp.barrier()


def _launch(world: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """One run on ``world`` ranks; per step the slowest rank's wall time and the ranks' mean CPU time."""
    with tempfile.TemporaryDirectory(prefix="smp2ds-bench-") as tmp:
        out = os.path.join(tmp, "times")
        mp.start_processes(_worker, args=(world, args, f"file://{tmp}/rdv", out), nprocs=world, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(f"{out}.{r}") as handle:
                ranks.append(json.load(handle))
    if {(r["tp"], r["rdp"]) for r in ranks} != {(2, world // 2)}:
        raise RuntimeError(f"unexpected layout on {world} ranks: {[(r['tp'], r['rdp']) for r in ranks]}")
    return {"wall": [max(r["wall"][k] for r in ranks) for k in range(args.steps)],
            "cpu": [statistics.mean(r["cpu"][k] for r in ranks) for k in range(args.steps)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="launches of each layout, alternating")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per launch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch handed to smp.step")
    args = parser.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}, per-rank batch "
          f"{args.batch}, AdamW, fp32; {args.rounds} alternating launches x {args.steps} steps (after "
          f"{args.warmup}); {cpus} CPUs, load average before: {os.getloadavg()[0]:.1f}")
    runs: dict[str, dict[str, list[float]]] = {"tp2": {"wall": [], "cpu": []}, "tp2xdp2": {"wall": [], "cpu": []}}
    for _ in range(args.rounds):
        for name, world in (("tp2", 2), ("tp2xdp2", 4)):
            got = _launch(world, args)
            for key in ("wall", "cpu"):
                runs[name][key] += got[key]
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in runs.items()}
    factor = (4 / min(4, cpus)) / (2 / min(2, cpus))
    ideal = med["tp2"]["wall"] * factor
    print(f"{'layout':<10}{'ranks':>6}{'wall s/step':>13}{'min':>8}{'max':>8}{'cpu s/rank/step':>17}")
    for name, world in (("tp2", 2), ("tp2xdp2", 4)):
        w = runs[name]["wall"]
        print(f"{name:<10}{world:>6}{med[name]['wall']:>13.4f}{min(w):>8.4f}{max(w):>8.4f}{med[name]['cpu']:>17.4f}")
    wall_ratio = med["tp2xdp2"]["wall"] / ideal
    cpu_ratio = med["tp2xdp2"]["cpu"] / med["tp2"]["cpu"]
    print(f"ideal tp2xdp2 = T(tp2) x {factor:g} = {ideal:.4f} s")
    print(f"{'PASS' if wall_ratio <= TARGET else 'FAIL'}  wall: tp2xdp2 / ideal = {wall_ratio:.3f} "
          f"(target <= {TARGET})")
    print(f"{'PASS' if cpu_ratio <= TARGET else 'FAIL'}  cpu:  tp2xdp2 / tp2 per rank = {cpu_ratio:.3f} "
          f"(target <= {TARGET})")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0 if wall_ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
