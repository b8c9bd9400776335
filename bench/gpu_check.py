"""The prepared device check: functional SMP scripts and the step-time table, one command, one table.

``python bench/gpu_check.py --device cuda`` (3 minutes on one H200 with ``--precisions bf16 --steps 30``;
all defaults about 6) or
``--device cpu`` (tiny sizes, CI):

1. ``examples/train_smp_mlp.py`` unchanged under ``torchrun`` (1 process, 2 micro-batches); its final
   weights must equal plain PyTorch training on the same batches;
2. SMP-style GPT-2 scripts in bf16 and fp16, the Hugging Face model kept and replaced by SMP's distributed
   transformer (``--flash-attention on|off|auto``: also with ``flash_attention=True``; ``auto`` runs it and
   reports "skipped" when smp2ds refuses the setting); losses must equal native DeepSpeed's with the same
   config and follow fp32 Hugging Face training;
3. ``smp2ds explain --memory``'s estimate for an SMP-style GPT-2 step (124M at batch 8 x 1024 on cuda, bf16,
   every block checkpointed) against ``torch.cuda.max_memory_allocated`` (on cpu: the live-storage counter),
   within 10 %;
4. step time of the same GPT-2 (124M and 355M at batch 8 x 1024 on cuda, tiny on cpu; activation
   checkpointing of every block; AdamW) for plain PyTorch (autocast), native DeepSpeed
   (``deepspeed.initialize`` with ZeRO 0 and exactly the DeepSpeed config smp2ds builds) and smp2ds
   (``smp.init`` + ``smp.DistributedModel`` + ``@smp.step``): median and best step after warm-up, the
   ratio to DeepSpeed and, on cuda, ``torch.cuda.max_memory_allocated``; also smp2ds with the GPT-2 replaced by
   SMP's distributed transformer at tensor_parallel_degree 1 (its ratio to the kept Hugging Face model, SDPA, in
   the detail), and native DeepSpeed and smp2ds compiled (``engine.compile()``; ``SMP2DS_COMPILE=1``).

Each case runs in its own process with a timeout, so one failure does not hide the others. The exit
status is 1 when any case failed (skipped ones do not count), 2 for a usage error.

On a bare GPU image without a package index: run ``python bench/gpu_check.py --prepare-wheels DIR`` where
the index is reachable (it builds DeepSpeed's wheel and downloads what DeepSpeed and jsonschema need beyond
torch, transformers and accelerate, for Pythons 3.10 to 3.13), carry DIR along and pass ``--wheels DIR``:
missing packages are installed with ``pip install --no-index --find-links DIR``; smp2ds itself is used from
this checkout (``PYTHONPATH``, no install).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_wheels  # noqa: E402 - this folder is not a package

ROOT = gpu_check_wheels.ROOT
CASES_SCRIPT = Path(__file__).resolve().parent / "gpu_check_cases.py"
RUNNERS = ("plain", "deepspeed", "smp2ds", "smp2ds_dt", "deepspeed_compile", "smp2ds_compile")
RUNNER_NAMES = {"plain": "plain PyTorch", "deepspeed": "DeepSpeed", "smp2ds": "smp2ds",
                "smp2ds_dt": "smp2ds, distributed transformer (tp 1)", "deepspeed_compile": "DeepSpeed, compile",
                "smp2ds_compile": "smp2ds, SMP2DS_COMPILE=1"}
KEPT_MODEL_TARGET = 1.00
"""The distributed transformer's step time over the kept Hugging Face model's (SDPA), at most (issue 31)."""
DEFAULTS = {  # device -> timing sizes, precisions, warm-up and measured steps, per-case timeout (s), parallel jobs
    "cuda": {"sizes": ["124M", "355M"], "precisions": ["bf16", "fp16"], "warmup": 5, "steps": 50, "timeout": 240,
             "jobs": 4},
    "cpu": {"sizes": ["tiny"], "precisions": ["bf16"], "warmup": 2, "steps": 8, "timeout": 240, "jobs": 3},
}
DS_LOSS_RTOL = 1e-3
"""smp2ds's GPT-2 losses against native DeepSpeed with the same config: the same arithmetic (the replaced
distributed transformer sums in another order, so not bit for bit)."""
CPU_FP16_NOTE = ("fp16 step times are not taken on cpu: DeepSpeed's CPU accelerator refuses fp16 without oneDNN "
                 "fp16 kernels (the functional fp16 scripts run with SMP2DS_ALLOW_CPU_FP16=1)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(base: dict[str, str], device: str) -> dict[str, str]:
    env = {**base, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if device == "cpu":
        env.update({"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "SMP2DS_ALLOW_CPU_FP16": "1"})
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _rank_env(env: dict[str, str]) -> dict[str, str]:
    """One rank of a one-process job, as torchrun would set it."""
    return {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


def _run(cmd: list[str], env: dict[str, str], timeout: float, log: Path) -> tuple[int | None, float]:
    """Run ``cmd`` with its output in ``log``; (exit status or None on timeout, seconds). On timeout it gets
    SIGTERM (torchrun then stops its workers, which live in process groups of their own), then its process
    group SIGKILL."""
    start = time.monotonic()
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its group
            except ProcessLookupError:
                pass
            proc.wait()
            rc = None
    return rc, time.monotonic() - start


def _tail(log: Path, lines: int = 3) -> str:
    text = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(text[-lines:])[-400:]


def run_case(name: str, spec: dict[str, Any], env: dict[str, str], timeout: float, tmp: Path) -> dict[str, Any]:
    """One case of ``gpu_check_cases.py`` in its own process; its result dict plus name and seconds."""
    slug = "".join(c if c.isalnum() else "_" for c in name)
    out, log = tmp / f"{slug}.json", tmp / f"{slug}.log"
    rc, secs = _run([sys.executable, str(CASES_SCRIPT), json.dumps(spec), str(out)], _rank_env(env), timeout, log)
    if out.exists():
        result = json.loads(out.read_text())
    elif rc is None:
        result = {"status": "failed", "detail": f"timed out after {timeout:.0f} s: {_tail(log)}"}
    else:
        result = {"status": "failed", "detail": f"exit {rc}: {_tail(log)}"}
    print(f"[{secs:5.1f} s] {name}: {result['status']} {result.get('detail', '')}".rstrip(), flush=True)
    return {**result, "name": name, "seconds": secs}


def mlp_example(env: dict[str, str], device: str, timeout: float, tmp: Path) -> dict[str, Any]:
    """``examples/train_smp_mlp.py`` unchanged under torchrun (1 process), then its weights checked."""
    steps, batch, lr = 8, 8, 0.05
    weights = tmp / "mlp_weights.pt"
    run_env = {**env, "SM_HP_MP_PARAMETERS": json.dumps({"ddp": True, "microbatches": 2})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(ROOT / "examples" / "train_smp_mlp.py"), "--steps", str(steps), "--batch-size", str(batch),
           "--lr", str(lr), "--dump-weights", str(weights)]
    log = tmp / "mlp_example.log"
    name = "mlp example, torchrun 1 process"
    rc, secs = _run(cmd, run_env, timeout, log)
    if rc != 0 or not weights.exists():
        why = "timed out" if rc is None else f"exit {rc}"
        print(f"[{secs:5.1f} s] {name}: failed {why}", flush=True)
        return {"name": name, "status": "failed", "detail": f"{why}: {_tail(log)}", "seconds": secs}
    spec = {"case": "mlp_compare", "weights": str(weights), "steps": steps, "batch": batch, "lr": lr,
            "rtol": 1e-3 if device == "cuda" else 1e-4}
    result = run_case(name + " (weights check)", spec, env, timeout, tmp)
    return {**result, "name": name, "seconds": secs + result["seconds"]}


def functional_cases(device: str, flash: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, spec) of the GPT-2 scripts; per precision first native DeepSpeed, the losses the others must give."""
    cases = []
    for precision in ("bf16", "fp16"):
        cases.append((f"GPT-2, native DeepSpeed {precision}", {"case": "gpt2_deepspeed", "device": device,
                                                                "precision": precision}))
        for transformer, label in (("hf", "GPT-2, HF model kept"), ("dt", "GPT-2, distributed transformer")):
            if device == "cpu" and precision == "fp16" and transformer == "dt":
                continue  # CI time: on cpu fp16 runs the kept model only (the replaced one runs in bf16)
            flashes = ["off"] + ([flash] if transformer == "dt" and flash != "off" else [])
            for fl in flashes:
                suffix = ", flash_attention" if fl != "off" else ""
                cases.append((f"{label}{suffix} {precision}",
                              {"case": "gpt2", "device": device, "precision": precision, "transformer": transformer,
                               "flash": fl}))
    return cases


def hold_to_deepspeed(rows: list[dict[str, Any]]) -> None:
    """Fail a GPT-2 script whose losses differ from native DeepSpeed's at the same precision."""
    for precision in ("bf16", "fp16"):
        native = next((r for r in rows if r["name"] == f"GPT-2, native DeepSpeed {precision}"), None)
        if native is None or native["status"] != "ok":
            continue
        for row in rows:
            if row is native or not row["name"].endswith(precision) or row["status"] != "ok" or "losses" not in row:
                continue
            rel = max(abs(g - w) / abs(w) for g, w in zip(row["losses"], native["losses"]))
            if rel <= DS_LOSS_RTOL:
                row["detail"] += f"; vs native DeepSpeed {rel:.2g}"
            else:
                row["status"] = "failed"
                row["detail"] += (f"; losses {row['losses']} differ from native DeepSpeed's {native['losses']} "
                                  f"by {rel:.3g} relative (allowed {DS_LOSS_RTOL})")


def combine_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One runner's timing over several rounds (each a fresh process): the median of the rounds' medians and
    the best step of all; failed if any round failed. One round is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        return failed[0]
    medians = [r["median_s"] for r in runs]
    combined = {**runs[0], "median_s": statistics.median(medians), "best_s": min(r["best_s"] for r in runs),
                "peak_gib": max((r.get("peak_gib") or 0.0) for r in runs) or None}
    combined["suspects"] = "; ".join(filter(None, [
        runs[0].get("suspects"), "round medians ms " + " ".join(f"{m * 1e3:.1f}" for m in medians),
        "losses of later rounds " + " ".join(f"{r['loss']:.4f}" for r in runs[1:])]))
    return combined


def timing_rows(results: dict[str, dict[str, Any]], size: str, precision: str) -> list[dict[str, Any]]:
    """Add the ratio to DeepSpeed and the same-config note to one size/precision group."""
    ds = results["deepspeed"]
    rows = []
    for runner in (r for r in RUNNERS if r in results):
        row = results[runner]
        if row["status"] == "ok" and ds["status"] == "ok":
            row["ratio"] = row["median_s"] / ds["median_s"]
            row["best_ratio"] = row["best_s"] / ds["best_s"]
        if row["status"] == "ok":
            suspects = f"; {row['suspects']}" if row.get("suspects") else ""
            row.setdefault("detail", f"loss after {row['steps']} timed steps {row['loss']:.4f}{suspects}")
        rows.append(row)
    dt, kept = results.get("smp2ds_dt"), results["smp2ds"]
    if dt is not None and dt["status"] == "ok" and kept["status"] == "ok":
        vs_kept = dt["median_s"] / kept["median_s"]
        dt["detail"] = dt.get("detail", "") + (f"; {vs_kept:.3f}x the kept HF model (SDPA), target <= "
                                               f"{KEPT_MODEL_TARGET:.2f}")
    smp = results["smp2ds"]
    if smp.get("ds_config") and ds.get("ds_config"):
        same = smp["ds_config"] == ds["ds_config"]
        smp["detail"] = smp.get("detail", "") + ("; DeepSpeed config same as native" if same else
                                                 "; DeepSpeed config DIFFERS from native")
    return rows


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]], notes: list[str]) -> None:
    header = ("case", "result", "median s", "best s", "x DS", "best x DS", "peak GiB", "detail")
    lines = [(r["name"], r["status"].upper(), _fmt(r.get("median_s"), ".4f"), _fmt(r.get("best_s"), ".4f"),
              _fmt(r.get("ratio"), ".3f"), _fmt(r.get("best_ratio"), ".3f"), _fmt(r.get("peak_gib"), ".2f"),
              r.get("detail", "")) for r in rows]
    widths = [max([len(h), *(len(line[i]) for line in lines)]) for i, h in enumerate(header[:-1])]
    for line in (header, tuple("-" * w for w in widths) + ("------",), *lines):
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
              + "  " + line[-1])
    for note in notes:
        print(note)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--wheels", type=Path, help="install missing deepspeed/jsonschema from these wheels")
    parser.add_argument("--prepare-wheels", type=Path, metavar="DIR", help="build/download the wheels, then exit")
    parser.add_argument("--python-version", nargs="+", default=list(gpu_check_wheels.PYTHONS),
                        help="--prepare-wheels: the target Pythons (default: 3.10 to 3.13)")
    parser.add_argument("--platform", nargs="+", default=list(gpu_check_wheels.PLATFORMS),
                        help="--prepare-wheels: the target platform tags (default: x86-64 Linux, glibc >= 2.28)")
    parser.add_argument("--flash-attention", choices=["auto", "on", "off"], default="auto",
                        help="also run the distributed transformer with flash_attention=True (auto: skip if refused)")
    parser.add_argument("--sizes", nargs="+", choices=["124M", "355M", "tiny"],
                        help="GPT-2 sizes of the step-time table")
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp16"])
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--steps", type=int, help="timed steps per runner")
    parser.add_argument("--timeout", type=float, help="seconds per case")
    parser.add_argument("--rounds", type=int, default=1,
                        help="timing rounds per size and precision, runner order rotated each round")
    parser.add_argument("--jobs", type=int, help="functional cases run side by side (timing runs alone)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["mlp", "gpt2", "memory", "timing"])
    parser.add_argument("--json", type=Path, help="also write every row to this file")
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _progress(row: dict[str, Any], started: float, rows: list[dict[str, Any]], json_path: Path | None,
              ) -> dict[str, Any]:
    """Print one finished case at once and rewrite the JSON file with what is known so far, so that a run cut
    off by its time limit still leaves every finished case behind; returns ``row``."""
    extra = f" median {row['median_s'] * 1e3:.1f} ms" if "median_s" in row else ""
    if row["status"] == "failed":
        extra = f" {str(row.get('detail', ''))[-400:]}"
    print(f"[{time.monotonic() - started:5.0f} s] {row['name']}: {row['status']}{extra}", flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps([*rows, row], indent=1, default=str))
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare_wheels:
        return gpu_check_wheels.prepare(args.prepare_wheels, args.python_version, args.platform)
    problems, base_env = gpu_check_wheels.ensure(args.wheels)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    env = _env(base_env, args.device)
    rows: list[dict[str, Any]] = []
    notes = [f"device {args.device}; timing: GPT-2 sizes {args.sizes}, median of {args.steps} steps after "
             f"{args.warmup} warm-up, each runner in its own process; x DS = median / DeepSpeed's median"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="smp2ds-gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        # the functional cases are small and independent: run them side by side, before any timing
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = []
            if "mlp" not in args.skip:
                futures.append(pool.submit(mlp_example, env, args.device, args.timeout, tmp))
            if "gpt2" not in args.skip:
                futures += [pool.submit(run_case, name, spec, env, args.timeout, tmp)
                            for name, spec in functional_cases(args.device, args.flash_attention)]
            if "memory" not in args.skip:
                futures.append(pool.submit(run_case, "GPT-2 bf16, memory estimate vs measured peak",
                                           {"case": "memory", "device": args.device, "tmp": str(tmp)}, env,
                                           args.timeout, tmp))
            for future in futures:
                rows.append(_progress(future.result(), started, rows, args.json))
        hold_to_deepspeed(rows)
        if "timing" not in args.skip:
            if args.device == "cpu" and "fp16" in args.precisions:
                args.precisions = [p for p in args.precisions if p != "fp16"]
            if args.device == "cpu":
                notes.append(CPU_FP16_NOTE)
            for size in args.sizes:
                for precision in args.precisions:
                    per_runner: dict[str, list[dict[str, Any]]] = {r: [] for r in RUNNERS}
                    for round_index in range(args.rounds):
                        # rotate the order each round, so drift of clocks or load does not favour one runner
                        order = RUNNERS[round_index % len(RUNNERS):] + RUNNERS[:round_index % len(RUNNERS)]
                        for r in order:
                            spec = {"case": "time", "device": args.device, "runner": r, "size": size,
                                    "precision": precision, "warmup": args.warmup, "steps": args.steps}
                            name = f"GPT-2 {size} {precision}: {RUNNER_NAMES[r]}"
                            per_runner[r].append(_progress(run_case(name, spec, env, args.timeout, tmp),
                                                           started, rows, args.json))
                    results = {r: combine_rounds(runs) for r, runs in per_runner.items()}
                    rows += timing_rows(results, size, precision)
    notes.append(f"whole check {time.monotonic() - started:.0f} s")
    print()
    print_table(rows, notes)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    failed = [r["name"] for r in rows if r["status"] == "failed"]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
