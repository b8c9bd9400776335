"""Host-side cost of one ``smp.step`` beside DeepSpeed's own engine step, and where smp2ds's extra time goes.

A launch-bound model (``--layers`` small ``Linear`` + ``Tanh`` layers, a tiny batch) makes every step mostly
Python and dispatch, so the difference between the two loops is the host cost smp2ds adds. Both train the
same model on the same data with the same DeepSpeed config (the one smp2ds builds), in the same processes,
in interleaved rounds (machine noise hits both alike):

* smp2ds: ``optimizer.zero_grad()``, an ``@smp.step`` function calling ``model(x)`` and
  ``model.backward(loss)`` over ``--microbatches`` micro-batches, ``.reduce_mean()``, ``optimizer.step()``;
* DeepSpeed: ``engine(x_i)``, ``engine.backward(loss)``, ``engine.step()`` per micro-batch with
  ``gradient_accumulation_steps = microbatches`` (DeepSpeed's own accumulation).

Then a breakdown pass wraps the functions of both paths in timers (inclusive wall time per step; the timers
add a little, so the medians above come from the unwrapped rounds) and times the failure watchdog's ticks,
which run in their own thread. Prints medians, the ratio (target <= 1.05) and the breakdown. Usage:
``python bench/step_overhead.py [--layers 64 --width 32 --batch 4] [--precision bf16] [--world 2 --zero 1]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _model(layers: int, width: int):
    import torch

    torch.manual_seed(0)
    body: list[torch.nn.Module] = []
    for _ in range(layers):
        body += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*body, torch.nn.Linear(width, 1))


class Timers:
    """Inclusive time per label of patched functions and step (a label nested in itself counts once), on the
    CPU clock of the calling thread: host cost, less moved than wall time by other processes' load."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = [defaultdict(float)]
        self.calls: dict[str, int] = defaultdict(int)
        self._active: set[str] = set()

    def next_step(self) -> None:
        self.steps.append(defaultdict(float))

    def median(self, label: str, inner: tuple[str, ...] = ()) -> float:
        """Median over steps of ``label``'s time less its ``inner`` labels' (the same step's, so consistent)."""
        return statistics.median(st.get(label, 0.0) - sum(st.get(k, 0.0) for k in inner) for st in self.steps)

    def wrap(self, label: str, func: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if label in self._active:
                return func(*args, **kwargs)
            self._active.add(label)
            start = time.thread_time()
            try:
                return func(*args, **kwargs)
            finally:
                self.steps[-1][label] += time.thread_time() - start
                self.calls[label] += 1
                self._active.discard(label)

        return timed

    @staticmethod
    def overhead_s(calls: int = 20000) -> float:
        """CPU seconds one timed call adds (a wrapped no-op against the bare one)."""
        probe = Timers()
        timed, bare = probe.wrap("calibration", lambda: None), (lambda: None)
        costs = []
        for fn in (timed, bare):
            start = time.thread_time()
            for _ in range(calls):
                fn()
            costs.append((time.thread_time() - start) / calls)
        return max(0.0, costs[0] - costs[1])

    @contextmanager
    def patched(self, targets: list[tuple[Any, str, str]]) -> Iterator[None]:
        saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in targets]
        try:
            for owner, name, label in targets:
                setattr(owner, name, self.wrap(label, owner.__dict__[name]))
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


def _targets() -> tuple[list[tuple[Any, str, str]], list[tuple[Any, str, str]]]:
    """(smp2ds probes, DeepSpeed probes): (owner, attribute, label). Labels starting with a space are
    parts of the label above them in the printed breakdown."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from smp2ds.engine.api import step
    from smp2ds.engine.api.model import DistributedModel
    from smp2ds.engine.api.optimizer import DistributedOptimizer
    from smp2ds.engine.core import model_io
    from smp2ds.engine.core.step_output import StepOutput
    from smp2ds.engine.data_parallel.backend import DataParallelBackend
    from smp2ds.engine.diagnostics import step_log

    engine = [(DeepSpeedEngine, "forward", "engine.forward"), (DeepSpeedEngine, "backward", "engine.backward"),
              (DeepSpeedEngine, "step", "engine.step"),
              (DeepSpeedEngine, "allreduce_gradients", "engine.allreduce_gradients")]
    smp = [(step.StepFunction, "__call__", "@smp.step call"), (step.StepFunction, "split", "split inputs"),
           (step, "collect", "collect outputs"), (step_log, "step_started", "step log"),
           (step_log, "step_finished", "step log"), (DataParallelBackend, "run_step", "backend.run_step"),
           (DistributedModel, "run_step", "DistributedModel.run_step"),
           (DistributedModel, "forward", "DistributedModel.forward"), (model_io, "cast_floating", "dtype casts"),
           (DistributedModel, "backward", "model.backward"), (StepOutput, "reduce_mean", "reduce_mean"),
           (DistributedOptimizer, "zero_grad", "optimizer.zero_grad"),
           (DistributedOptimizer, "step", "optimizer.step"),
           (DataParallelBackend, "sync_gradients", "sync_gradients")]
    return smp + engine, engine


ENGINE_CALLS = ("engine.forward", "engine.backward", "engine.step", "engine.allreduce_gradients")
BREAKDOWN = [  # (label, the labels inside it that are DeepSpeed's or listed apart, text): smp2ds's own cost
    ("optimizer.zero_grad", (), "optimizer.zero_grad (DeepSpeed's loop zeroes in engine.step)"),
    ("@smp.step call", ("DistributedModel.run_step", "collect outputs", "step log"),
     "@smp.step call itself (state checks, dropping the step's outputs)"),
    ("DistributedModel.run_step", ("backend.run_step", "sync_gradients"), "DistributedModel.run_step itself"),
    ("backend.run_step", ("split inputs", "DistributedModel.forward", "model.backward"),
     "micro-batch loop itself (+ the step function's own code)"),
    ("split inputs", (), "split inputs into micro-batches"),
    ("DistributedModel.forward", ("engine.forward",), "DistributedModel.forward beyond engine.forward"),
    ("dtype casts", (), "  of which dtype casts of inputs/outputs"),
    ("model.backward", ("engine.backward",), "model.backward beyond engine.backward"),
    ("sync_gradients", ("engine.allreduce_gradients",), "sync_gradients beyond engine.allreduce_gradients"),
    ("collect outputs", (), "collect outputs (StepOutput)"),
    ("step log", (), "step log (SMP2DS_LOG off)"),
    ("reduce_mean", (), "StepOutput.reduce_mean"),
    ("optimizer.step", ("engine.step",), "optimizer.step beyond engine.step"),
]


def _worker(rank: int, args: argparse.Namespace, rdv: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(args.world), "SMP2DS_INIT_METHOD": rdv, "OMP_NUM_THREADS": "1",
                       "DS_ACCELERATOR": "cpu"})
    import deepspeed
    import torch
    import torch.nn.functional as F
    from gpu_check_cases import smp2ds_deepspeed_config

    import smdistributed.modelparallel.torch as smp
    from smp2ds.engine.diagnostics.watchdog import Watchdog

    m = args.microbatches
    smp_params = {"ddp": True, "microbatches": m, "shard_optimizer_state": args.zero == 1}
    if args.precision != "fp32":
        smp_params[args.precision] = True
    smp.init(smp_params)
    model = smp.DistributedModel(_model(args.layers, args.width))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3))

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    ds_model = _model(args.layers, args.width)
    config = smp2ds_deepspeed_config(smp_params, {}, world_size=args.world)
    config["train_micro_batch_size_per_gpu"] = args.batch // m
    engine, *_ = deepspeed.initialize(model=ds_model, optimizer=torch.optim.Adam(ds_model.parameters(), lr=1e-3),
                                      config=config)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, 1, generator=g)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]

    def smp_step() -> None:
        opt.zero_grad()
        train_step(model, x, y).reduce_mean()
        opt.step()

    def ds_step() -> None:
        for xm, ym in zip(x.chunk(m), y.chunk(m)):
            # DeepSpeed's engine leaves input casting to the script; smp2ds casts them (SMP's 16-bit wrapper)
            loss = F.mse_loss(engine(xm.to(dtype)).float(), ym)
            engine.backward(loss)
            engine.step()

    times: dict[str, list[float]] = {"smp": [], "deepspeed": [], "smp_cpu": [], "deepspeed_cpu": []}
    for fn in (smp_step, ds_step):  # warm-up
        for _ in range(3):
            fn()
    for _ in range(args.rounds):
        for name, fn in (("smp", smp_step), ("deepspeed", ds_step)):
            smp.barrier()
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                times[name].append(time.perf_counter() - t0)
                times[name + "_cpu"].append(time.thread_time() - c0)
    smp_probes, ds_probes = _targets()
    parts: dict[str, dict[str, float]] = {}
    for name, fn, probes in (("smp", smp_step, smp_probes), ("deepspeed", ds_step, ds_probes)):
        timers = Timers()
        with timers.patched(probes):
            smp.barrier()
            for i in range(args.profile_steps):
                if i:
                    timers.next_step()
                fn()
        parts[name] = {label: timers.median(label) for label in ENGINE_CALLS}
        if name == "smp":
            parts["probes"] = {"calls_per_step": sum(timers.calls.values()) / args.profile_steps,
                               "overhead_s": Timers.overhead_s()}
            own = {text: timers.median(label, inner) for label, inner, text in BREAKDOWN if timers.calls[label]}
            parts["own"] = own
            # the sum per step, then its median (rows starting with a space are parts of the row above)
            parts["own_sum"] = {"sum": statistics.median(
                sum(st.get(label, 0.0) - sum(st.get(k, 0.0) for k in inner) for label, inner, text in BREAKDOWN
                    if not text.startswith(" ")) for st in timers.steps)}
    ticks = Timers()
    if smp.state.watchdog is not None:  # started at world size > 1 only (engine/api/init.py)
        with ticks.patched([(Watchdog, "_tick", "tick")]):
            time.sleep(args.watchdog_s)  # the watchdog's own thread keeps ticking meanwhile
    report = {"times": times, "parts": parts, "ticks": ticks.calls["tick"],
              "tick_s": ticks.steps[0]["tick"], "watchdog_s": args.watchdog_s,
              "watchdog": smp.state.watchdog is not None}
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(report, handle)
    smp.barrier()


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value * 1e3:8.3f}"


def print_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    times, parts = report["times"], report["parts"]
    print(f"layout: {args.world} rank(s), microbatches {args.microbatches}, ZeRO stage {args.zero}, {args.precision}; "
          f"model {args.layers} x (Linear({args.width},{args.width}) + Tanh) + Linear({args.width},1), "
          f"batch {args.batch} per rank; {args.rounds}x{args.steps} steps each, interleaved")
    for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
        smp_s, ds_s = statistics.median(times["smp" + suffix]), statistics.median(times["deepspeed" + suffix])
        print(f"{clock:>4}: smp.step + DistributedModel median {smp_s * 1e3:.3f} ms/step "
              f"(best {min(times['smp' + suffix]) * 1e3:.3f}); DeepSpeed loop median {ds_s * 1e3:.3f} "
              f"(best {min(times['deepspeed' + suffix]) * 1e3:.3f}); ratio {smp_s / ds_s:.3f}, "
              f"extra {(smp_s - ds_s) * 1e3:.3f} ms/step (target <= 1.05) "
              f"{'PASS' if smp_s <= 1.05 * ds_s else 'FAIL'}")
    smp_p, ds_p = parts["smp"], parts["deepspeed"]
    print(f"\nwhere smp2ds's own time goes, main-thread CPU ms per step (median over {args.profile_steps} steps):")
    for text, value in parts["own"].items():
        print(f"  {text:<62}{_ms(value)}")
    print(f"  {'sum: smp2ds own code per step':<62}{_ms(parts['own_sum']['sum'])}")
    probes = parts["probes"]
    print(f"  (the timers themselves: {probes['calls_per_step']:.0f} timed calls per step x "
          f"{probes['overhead_s'] * 1e6:.1f} us = {_ms(probes['calls_per_step'] * probes['overhead_s']).strip()} ms "
          "of that sum, mostly in the rows ending 'itself')")
    print("DeepSpeed engine calls, CPU ms per step (smp2ds's step | DeepSpeed loop):")
    for label in ENGINE_CALLS:
        print(f"  {label:<62}{_ms(smp_p.get(label, 0.0))} | {_ms(ds_p.get(label, 0.0))}")
    if not report["watchdog"]:
        print("failure watchdog: not running (smp2ds starts it at world size > 1 only)")
        return
    ticks, tick_s = report["ticks"], report["tick_s"]
    mean = tick_s / ticks if ticks else 0.0
    print(f"failure watchdog (own thread): {ticks} ticks in {report['watchdog_s']:.1f} s, {mean * 1e3:.3f} ms CPU "
          "each (its store round trips release the GIL)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--zero", type=int, choices=[0, 1], default=0, help="1 = shard_optimizer_state")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=100)
    parser.add_argument("--watchdog-s", type=float, default=3.0, help="seconds to time the watchdog's ticks")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="smp2ds-bench-") as tmp:
        out = os.path.join(tmp, "report.json")
        mp.start_processes(_worker, args=(args, f"file://{tmp}/rdv", out), nprocs=args.world, start_method="spawn")
        with open(out) as handle:
            report = json.load(handle)
    print_report(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
