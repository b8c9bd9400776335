"""Estimated against measured peak memory of one training step, per rank, on CPU ranks.

For each row (model family x layout x activation checkpointing) two ranks run two real training steps of the
engine (``smp.DistributedModel``, ``smp.DistributedOptimizer``, Adam) under a counter of live tensor storages
(``smp2ds.engine.memory.measure.LiveTensorBytes``, independent of the tracker the estimate uses), and each rank's
peak is compared with ``smp2ds explain --memory``'s estimate for its role (pipeline stage). The process's peak RSS
is shown as a second figure: it also holds the interpreter and the libraries, and the untouched pages of large
empty buffers are not resident on CPU. The rank bodies and rows are ``tests/engine/workers/memory_workers.py`` (the
corrections they make to the measurement are explained there).

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python3 bench/memory_estimate_accuracy.py [--rows gpt2-ddp,llama-pp2-ckpt]
        [--world-size 4]

``--counter allocator`` measures with PyTorch's CPU allocator's running total read from the profiler
(``smp2ds.engine.memory.measure.AllocatorPeak``) instead of the live-tensor counter: the two share no code. It
prints the allocator's figure as recorded and the one corrected for frees on threads the profiler does not record.

``--world-size 4`` runs the rows on four ranks: ``sdp2`` then shards over two ranks and keeps two replicas (the
replica all-reduce of sharded data parallelism), ``ddp`` and ``zero1`` reduce over four.

``--fit-check SIZE`` instead asks ``smp2ds explain --fit SIZE`` for the layouts of the seed configuration
``examples/configs/bert_pipeline_000.json`` (two ranks, the bench's small BERT, per-rank batch 12 x 128 tokens: its
12 micro-batches of one sample) and
measures the first one it proposes: the measured peak must stay within the device size it was asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from cpu_ranks import run  # noqa: E402

from tests.engine.workers import memory_workers as rows  # noqa: E402


def _rank(rank: int, family: str, layout: str, ckpt: bool, path: str, batch: int = rows.BATCH,
          seq: int = rows.SEQ, counter: str = "live") -> dict:
    return rows.measured_peak(family, layout, ckpt, path, batch, seq, counter)


FIT_BATCH = 12


def fit_check(size: str) -> None:
    import contextlib
    import io

    from smp2ds.cli import main as smp2ds

    seed = os.path.join(os.path.dirname(HERE), "examples", "configs", "bert_pipeline_000.json")
    with tempfile.TemporaryDirectory() as tmp:
        path = rows.write_config("bert", os.path.join(tmp, "bert.json"))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = smp2ds(["explain", seed, "--model", path, "--fit", size, "--world-size", "2", "--batch-size",
                           str(FIT_BATCH), "--seq-len", str(rows.SEQ), "--format", "json"])
        found = json.loads(out.getvalue())
        if code or not found["fitting"]:
            raise SystemExit(f"--fit {size} proposed nothing (exit {code})")
        best = found["fitting"][0]
        params, ckpt = best["smp_parameters"], best["activation_checkpointing"]
        print(f"--fit {size}: {len(found['fitting'])} of {found['layouts_tried']} layouts fit (usable "
              f"{found['usable_bytes'] / 2**20:.1f} MiB); first: {json.dumps(params, sort_keys=True)}"
              f"{' with checkpointing' if ckpt else ''}, estimated peak {best['peak'] / 2**20:.1f} MiB")
        for m in run(_rank, 2, "bert", params, ckpt, path, FIT_BATCH):
            verdict = "fits" if m["measured"] <= found["usable_bytes"] else "DOES NOT FIT"
            print(f"  rank {m['rank']}: measured {m['measured'] / 2**20:.1f} MiB: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated family-layout[-ckpt] rows (default: all)")
    parser.add_argument("--json", help="write the table as JSON here too")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per row (default 2)")
    parser.add_argument("--batch-size", type=int, default=rows.BATCH, help=f"per-rank batch (default {rows.BATCH})")
    parser.add_argument("--seq-len", type=int, default=rows.SEQ, help=f"tokens per sample (default {rows.SEQ})")
    parser.add_argument("--counter", choices=("live", "allocator"), default="live",
                        help="live tensor storages (default) or PyTorch's CPU allocator total from the profiler")
    parser.add_argument("--fit-check", metavar="SIZE", help="measure the first layout --fit SIZE proposes instead")
    args = parser.parse_args()
    if args.fit_check:
        fit_check(args.fit_check)
        return
    names = [r for r in args.rows.split(",") if r] or [
        f"{f}-{lay}{c}" for f in rows.FAMILIES for lay in rows.LAYOUTS for c in ("", "-ckpt")] + [
        "qwen2-tp2", "qwen2-tp2-ckpt"]
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            family, layout, *rest = name.split("-")
            ckpt = rest == ["ckpt"]
            path = rows.write_config(family, os.path.join(tmp, f"{family}.json"))
            try:
                roles = rows.estimated_roles(layout, ckpt, path, world=args.world_size, batch=args.batch_size,
                                             seq=args.seq_len)
            except ValueError as err:
                print(f"{name:22s} not estimated: {err}", flush=True)
                continue
            for m in run(_rank, args.world_size, family, layout, ckpt, path, args.batch_size, args.seq_len,
                         args.counter):
                est = roles[m["pp_rank"]]["total"]
                ratio = est / m["measured"]
                table.append({"row": name, **m, "estimate": est, "ratio": ratio})
                print(f"{name:22s} {args.world_size} ranks, rank {m['rank']}  estimate {est / 2**20:8.1f} MiB  "
                      f"measured {m['measured'] / 2**20:8.1f} MiB  ratio {ratio:5.3f}  "
                      f"(peak RSS {m['rss'] / 2**20:7.1f} MiB)" + (
                          f"  allocator as recorded {m['recorded'] / 2**20:8.1f} MiB, {m['unseen_frees']} free(s) "
                          "on unrecorded threads" if "recorded" in m else "") + (
                          "  freed on other threads " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in
                                                                  sorted(m["freed_elsewhere"].items()))
                          if m.get("freed_elsewhere") else ""), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(table, fh, indent=1)
    worst = max((abs(r["ratio"] - 1) for r in table), default=0.0)
    print(f"worst deviation {worst:.1%} over {len(table)} rank rows")


if __name__ == "__main__":
    main()
