"""Pipeline efficiency: pp=2 vs one rank doing the same work, and vs a hand-written DeepSpeed pipeline.

Same model (an nn.Sequential of identical dense blocks, so the two stages are balanced), same
per-step batch, same SGD optimizer; each process uses one CPU thread. Two processes are started
once; for every schedule (``interleaved`` = 1F1B, ``simple`` = GPipe) and micro-batch count m
they alternate, step by step:

* T1: rank 0 alone runs the m micro-batches forward+backward, then the optimizer (plain
  PyTorch, no DeepSpeed, no communication) while rank 1 waits at a barrier;
* T2: both ranks run the same step through the SMP-style pipeline (smp2ds PipelineRunner on
  DeepSpeed's PipelineEngine, gloo, the path ``@smp.step`` takes), from barrier to barrier;
* T3: both ranks run the same step as a hand-written DeepSpeed script would: ``PipelineModule``
  over the same layers (``partition_method="parameters"``: both splits
  put half the Linear layers on each stage; both are printed), ``deepspeed.initialize``,
  ``engine.train_batch(data_iter)`` (DeepSpeed's own 1F1B schedule, optimizer step included).

Printed per row (medians over ``--steps`` alternating steps):

* speed-up = T1 / T2, its share of the ideal p*m/(m+p-1) that only the pipeline bubble limits
  (target >= 0.8 at m = 4 and 8);
* smp2ds / DeepSpeed = T2 / T3 (target <= 1.05; rows whose schedule DeepSpeed does not have,
  GPipe, are not compared);
* idle = share of the step each rank spends outside its forward/backward instructions and its
  optimizer step, averaged over the ranks (bubble + communication + scheduling overhead), next to
  the bubble fraction (p-1)/(m+p-1);
* cpu-ovh = share of each rank's CPU time (thread time, so not inflated when other processes
  take the CPU) spent outside forward/backward/optimizer: the runner's and DeepSpeed's
  per-step software overhead (capture, scheduling, copies, result broadcast).

Two ranks need two free cores: on a machine shared with other jobs the speed-up measures the
scheduler as much as the pipeline; the load average is printed before and after.

Usage: python bench/pipeline_efficiency.py [--width 1024] [--blocks 8] [--batch 256] [--steps 8]
       [--microbatches 4 8] [--schedules interleaved simple]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import time

PP = 2
TARGET_SHARE, TARGET_VS_DS = 0.8, 1.05


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


def _deepspeed_engine(args, m: int):
    """The hand-written DeepSpeed pipeline: PipelineModule over the same layers, train_batch."""
    import deepspeed
    import torch
    import torch.nn.functional as F
    from deepspeed.pipe import PipelineModule

    layers = list(_model(args.width, args.blocks))
    module = PipelineModule(layers=layers, num_stages=PP, loss_fn=F.mse_loss, partition_method="parameters")
    cfg = {"train_micro_batch_size_per_gpu": args.batch // m, "gradient_accumulation_steps": m,
           "train_batch_size": args.batch, "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1}
    opt = torch.optim.SGD([p for p in module.parameters()], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    return engine, module.parts


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
                ds_engine, ds_parts = (_deepspeed_engine(args, m) if schedule == "interleaved" else (None, None))
                batches = list(zip(x.chunk(m), y.chunk(m)))
                if ds_engine is not None:
                    ds_engine.train_batch(iter(batches))  # warm-up
                busy = [0.0, 0.0]
                _timed_compute(runner, busy)
                t1, t2, t3, idle, overhead = [], [], [], [], []
                for _ in range(args.steps):  # alternate baseline, DeepSpeed and smp2ds steps
                    dist.barrier()
                    if rank == 0:
                        t1.append(_single(base, base_opt, x, y, m))
                    if ds_engine is not None:
                        dist.barrier()
                        t0 = time.perf_counter()
                        ds_engine.train_batch(iter(batches))
                        dist.barrier()
                        t3.append(time.perf_counter() - t0)
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
                split = runner.partition.describe()
                if ds_parts is not None:
                    split += f"\nDeepSpeed PipelineModule parts (layer boundaries): {[int(p) for p in ds_parts]}"
                rows.append((schedule, m, t1, t2, t3, idle, overhead, split))
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
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=["interleaved"])
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"model: {args.blocks} x Linear({args.width},{args.width})+Tanh, batch {args.batch}, p={PP}, "
          f"1 thread per rank, median of {args.steps} alternating steps; load average before: "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    got = _run(args)
    print(f"{'schedule':<12}{'m':>3}{'T1 1-rank':>10}{'T2 smp2ds':>10}{'T3 DS':>8}{'speed-up':>9}{'ideal':>7}"
          f"{'share':>7}{'T2/T3':>7}{'DS share':>9}{'idle':>7}{'bubble':>7}{'cpu-ovh':>8}")
    ok = True
    verdicts = []
    for i, (schedule, m, t1, t2, t3, idle0, ovh0, split) in enumerate(got[0]):  # noqa: B007
        idle1, ovh1 = got[1][i][5], got[1][i][6]
        s1, s2 = statistics.median(t1), statistics.median(t2)
        s3 = statistics.median(t3) if t3 else None
        idle = statistics.median(idle0 + idle1)
        ovh = statistics.median(ovh0 + ovh1)
        ideal = PP * m / (m + PP - 1)
        share = s1 / s2 / ideal
        vs_ds = s2 / s3 if s3 else None
        print(f"{schedule:<12}{m:>3}{s1:>10.4f}{s2:>10.4f}" + (f"{s3:>8.4f}" if s3 else f"{'-':>8}")
              + f"{s1 / s2:>9.2f}{ideal:>7.2f}{share:>7.3f}"
              + (f"{vs_ds:>7.3f}{s1 / s3 / ideal:>9.3f}" if s3 else f"{'-':>7}{'-':>9}")
              + f"{idle:>7.3f}{(PP - 1) / (m + PP - 1):>7.3f}{ovh:>8.3f}")
        if m in (4, 8):
            verdicts.append((share >= TARGET_SHARE, f"{schedule} m={m}: speed-up {s1 / s2:.2f} = {share:.3f} of the "
                             f"bubble ideal {ideal:.2f} (target >= {TARGET_SHARE})"))
        if vs_ds is not None:
            verdicts.append((vs_ds <= TARGET_VS_DS, f"{schedule} m={m}: smp2ds / DeepSpeed step time {vs_ds:.3f} "
                             f"(target <= {TARGET_VS_DS})"))
    print(split)
    for good, text in verdicts:
        print(f"{'PASS' if good else 'FAIL'}  {text}")
        ok &= good
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
