"""Where smp2ds's step time differs from native DeepSpeed's: both runners of ``bench/gpu_check.py``'s
timing (same GPT-2, same DeepSpeed config) under ``torch.profiler``, each in its own process, then the
operators whose per-step time differs most.

``python bench/step_profile.py --device cuda --size 124M --precision bf16`` (on cpu: ``--size tiny``).
Prints each runner's host wall time per profiled step, the summed device and host self time, and the
operators ranked by the difference (smp2ds minus DeepSpeed) of device time (cuda) or host time (cpu).
A profiled step is slower than an unprofiled one; compare the two runners, not these figures with
``gpu_check``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402 - this folder is not a package
import gpu_check_wheels  # noqa: E402

RUNNERS = ("deepspeed", "smp2ds")


def difference(ops: dict[str, list[dict]], key: str, top: int) -> list[tuple[str, float, float, float, float]]:
    """(operator, DeepSpeed ms, smp2ds ms, DeepSpeed calls, smp2ds calls) per step, largest |difference| first."""
    by_name = {r: {o["name"]: o for o in ops[r]} for r in RUNNERS}
    names = set(by_name["deepspeed"]) | set(by_name["smp2ds"])
    empty = {"device_ms": 0.0, "host_ms": 0.0, "calls": 0.0}
    rows = [(n, by_name["deepspeed"].get(n, empty)[key], by_name["smp2ds"].get(n, empty)[key],
             by_name["deepspeed"].get(n, empty)["calls"], by_name["smp2ds"].get(n, empty)["calls"]) for n in names]
    rows.sort(key=lambda r: abs(r[2] - r[1]), reverse=True)
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=["124M", "355M", "tiny"], default="124M")
    parser.add_argument("--precision", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=240)
    parser.add_argument("--wheels", type=Path, help="install missing deepspeed/jsonschema from these wheels")
    parser.add_argument("--json", type=Path, help="also write both runners' operator tables here")
    args = parser.parse_args(argv)
    problems, base_env = gpu_check_wheels.ensure(args.wheels)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    env = gpu_check._env(base_env, args.device)
    results = {}
    with tempfile.TemporaryDirectory(prefix="smp2ds-step-profile-") as tmp:
        for runner in RUNNERS:
            spec = {"case": "profile", "device": args.device, "runner": runner, "size": args.size,
                    "precision": args.precision, "warmup": args.warmup, "steps": args.steps}
            results[runner] = gpu_check.run_case(f"profile {runner}", spec, env, args.timeout, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    if any(r["status"] != "ok" for r in results.values()):
        return 1
    print(f"\nGPT-2 {args.size} {args.precision} on {args.device}, {args.steps} profiled steps after "
          f"{args.warmup} warm-up; per step:")
    for runner in RUNNERS:
        r = results[runner]
        print(f"  {runner:9s} wall {r['wall_ms']:8.2f} ms  device self {r['device_ms']:8.2f} ms  "
              f"host self {r['host_ms']:8.2f} ms")
    for key in (["device_ms"] if args.device == "cuda" else []) + ["host_ms"]:
        print(f"\nlargest differences of {key.replace('_ms', '')} time per step (ms), smp2ds - DeepSpeed:")
        print(f"  {'DS ms':>8s} {'smp2ds ms':>9s} {'diff':>8s} {'DS calls':>8s} {'calls':>6s}  operator")
        for name, ds, smp, ds_calls, smp_calls in difference({k: v["ops"] for k, v in results.items()}, key,
                                                             args.top):
            print(f"  {ds:8.3f} {smp:9.3f} {smp - ds:+8.3f} {ds_calls:8.1f} {smp_calls:6.1f}  {name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
