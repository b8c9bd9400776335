"""Pipeline efficiency: pp=2 on two ranks vs one rank doing the same work, micro-batches 2/4/8.

Same model (an nn.Sequential of identical dense blocks, so the two stages are balanced), same
per-step batch, same SGD optimizer; each process uses one CPU thread. Two processes are started
once; for every schedule (``interleaved`` = 1F1B, ``simple`` = GPipe) and micro-batch count m
they alternate, step by step:

* T1: rank 0 alone runs the m micro-batches forward+backward, then the optimizer (plain
  PyTorch, no DeepSpeed, no communication) while rank 1 waits at a barrier;
* T2: both ranks run the same step through the SMP-style pipeline (smp2ds PipelineRunner on
  DeepSpeed's PipelineEngine, gloo), from barrier to barrier.

Printed per row (best step of ``--steps``, which filters out interference on a shared machine):

* speed-up = T1 / T2, next to the ideal p*m/(m+p-1) that only the pipeline bubble limits;
* bubble = 1 - T1/(p*T2): share of the p ranks' time not spent on the baseline's useful work
  (pipeline bubble + communication + scheduling overhead);
* idle = share of the step each rank spends outside its forward/backward instructions and its
  optimizer step, averaged over the ranks (measured inside the pipeline, independent of the
  baseline): the bubble plus communication and scheduling overhead;
* ideal = the bubble fraction (p-1)/(m+p-1);
* cpu-ovh = share of each rank's CPU time (thread time, so not inflated when other processes
  take the CPU) spent outside forward/backward/optimizer: the runner's and DeepSpeed's
  per-step software overhead (capture, scheduling, copies, result broadcast).

The design target (design.md section 5) is a measured 1F1B bubble within 10% of the ideal.

Usage: python bench/pipeline_efficiency.py [--width 1024] [--blocks 8] [--batch 256] [--steps 8]
       [--microbatches 2 4 8] [--schedules interleaved simple]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time

PP = 2


def _model(width: int, blocks: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _data(batch: int, width: int):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def _step(model, x, y):
    import torch.nn.functional as F

    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def _single(model, opt, x, y, m: int) -> float:
    """One step on one rank, plain PyTorch: m micro-batches forward+backward, then the optimizer."""
    import torch.nn.functional as F

    t0 = time.perf_counter()
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        (F.mse_loss(model(xs), ys) / m).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def _timed_compute(runner, busy: list[float]) -> None:
    """Add this rank's wall (``busy[0]``) and CPU (``busy[1]``) time in forward/backward instructions."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    table = runner.engine._INSTRUCTION_MAP
    for kind in (ds_schedule.ForwardPass, ds_schedule.BackwardPass):
        inner = table[kind]

        def timed(eng, buffer_id, _inner=inner):
            t0, c0 = time.perf_counter(), time.thread_time()
            _inner(eng, buffer_id)
            busy[0] += time.perf_counter() - t0
            busy[1] += time.thread_time() - c0

        table[kind] = timed


def _rank(rank: int, init: str, args, out) -> None:
    """One pipeline rank; rank 0 also measures the single-rank baseline while rank 1 waits."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(PP), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=PP)
        from smp2ds.engine.pipeline import build_pipeline, plan_for
        from smp2ds.translator.topology import Topology

        x, y = _data(args.batch, args.width)
        rows = []
        for schedule in args.schedules:
            for m in args.microbatches:
                model = _model(args.width, args.blocks)
                cfg = {"pipeline_parallel_degree": PP, "microbatches": m, "pipeline": schedule,
                       "active_microbatches": m}
                runner = build_pipeline(model, plan_for(cfg, PP, {"gradient_clipping": 0.0}),
                                        Topology.for_world(PP, PP))
                runner.attach_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
                calls = [((runner, xs, ys), {}) for xs, ys in zip(x.chunk(m), y.chunk(m))]
                base = _model(args.width, args.blocks)
                base_opt = torch.optim.SGD(base.parameters(), lr=1e-3)
                runner.run_step(_step, calls)  # warm-up, creates the engine
                runner.optimizer_step()
                busy = [0.0, 0.0]
                _timed_compute(runner, busy)
                t1, t2, idle, overhead = [], [], [], []
                for _ in range(args.steps):  # alternate baseline and pipeline steps
                    dist.barrier()
                    if rank == 0:
                        t1.append(_single(base, base_opt, x, y, m))
                    dist.barrier()
                    busy[0] = busy[1] = 0.0
                    t0, c0 = time.perf_counter(), time.thread_time()
                    runner.run_step(_step, calls)
                    t_opt, c_opt = time.perf_counter(), time.thread_time()
                    runner.optimizer_step()
                    # the baseline counts its optimizer step as work too
                    busy[0] += time.perf_counter() - t_opt
                    busy[1] += time.thread_time() - c_opt
                    cpu = time.thread_time() - c0
                    dist.barrier()
                    t2.append(time.perf_counter() - t0)
                    idle.append(1 - busy[0] / t2[-1])
                    overhead.append(1 - busy[1] / cpu)
                rows.append((schedule, m, t1, t2, idle, overhead, runner.partition.describe()))
        dist.destroy_process_group()
        out.put((rank, rows, None))
    except BaseException:  # noqa: BLE001 - report to the parent instead of hanging it
        import traceback

        out.put((rank, None, traceback.format_exc()))


def _run(args) -> dict[int, list]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="smp2ds-pipe-bench-") as tmp:
        init = f"file://{tmp}/rendezvous"
        procs = [ctx.Process(target=_rank, args=(r, init, args, out)) for r in range(PP)]
        for p in procs:
            p.start()
        got: dict[int, list] = {}
        try:
            while len(got) < PP:
                rank, rows, error = out.get(timeout=args.timeout)
                if rows is None:
                    raise RuntimeError(f"pipeline rank {rank} failed:\n{error}")
                got[rank] = rows
        except queue.Empty:
            raise RuntimeError(f"pipeline ranks did not finish within {args.timeout}s") from None
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["interleaved", "simple"])
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"model: {args.blocks} x Linear({args.width},{args.width})+Tanh, batch {args.batch}, p={PP}, "
          f"1 thread per rank, best of {args.steps} alternating steps; load average before: "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    got = _run(args)
    print(f"{'schedule':<12}{'m':>3}{'T1 1-rank s':>13}{'T2 pp=2 s':>12}{'speed-up':>10}{'ideal':>8}"
          f"{'bubble':>9}{'idle':>8}{'ideal':>8}{'cpu-ovh':>9}")
    for i, (schedule, m, t1, t2, idle0, ovh0, split) in enumerate(got[0]):  # noqa: B007
        idle1, ovh1 = got[1][i][4], got[1][i][5]
        s1, s2 = min(t1), min(t2)
        # Shares per rank at the fastest pipeline step, averaged over the ranks.
        best = min(range(len(t2)), key=t2.__getitem__)
        idle, ovh = (idle0[best] + idle1[best]) / 2, (ovh0[best] + ovh1[best]) / 2
        ideal_bubble = (PP - 1) / (m + PP - 1)
        print(f"{schedule:<12}{m:>3}{s1:>13.4f}{s2:>12.4f}{s1 / s2:>10.2f}{PP * m / (m + PP - 1):>8.2f}"
              f"{1 - s1 / (PP * s2):>9.3f}{idle:>8.3f}{ideal_bubble:>8.3f}{ovh:>9.3f}")
    print(split)
    return 0


if __name__ == "__main__":
    sys.exit(main())
