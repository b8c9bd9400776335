"""Start-up cost of ``smp2ds convert`` against the floor our own dependency sets.

Measures, in one invocation and interleaved round by round (so machine noise hits every
command alike), the wall time of:

* ``python -c pass``                         (interpreter + site start-up, for reference)
* ``python -c "import jsonschema"``          (the floor: the translator validates with jsonschema)
* the translator's load/normalize/plan without the command line (what the CLI adds on top)
* ``smp2ds convert CONFIG`` (console script)  and ``python -m smp2ds.cli convert CONFIG``
* ``python -c "import torch"``               (what the CLI must never pay)

and prints medians with ratios to the jsonschema floor. Target (docs/internals.md#performance-targets): convert
<= 1.5x the floor. A valid config never imports jsonschema (translator/schema_fast.py answers
"valid" first), so convert is expected well below the floor; ``heavy modules imported`` of
``--importtime`` shows it. ``--importtime`` also lists the slowest imports of the convert path
(``python -X importtime``) to show where the time goes.

Usage: python bench/cli_startup.py [--runs 9] [--config examples/configs/gpt2_30b_sdp_002.json]
       [--importtime] [--check]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "examples", "configs", "gpt2_30b_sdp_002.json")
TARGET = 1.5


# The same work as `convert` without the command line, to show what the CLI itself adds.
TRANSLATOR_ONLY = (
    "import json, sys\n"
    "from smp2ds.translator.load import load_document\n"
    "from smp2ds.translator.normalize import normalize\n"
    "from smp2ds.translator.planner import plan\n"
    "print(json.dumps(dict(plan(normalize(load_document(sys.argv[1]))).deepspeed), indent=2))\n"
)


def console_script() -> list[str]:
    """The installed ``smp2ds`` script next to this interpreter (not a pyenv shim, which adds a bash hop)."""
    path = os.path.join(os.path.dirname(sys.executable), "smp2ds")
    return [path] if os.access(path, os.X_OK) else [sys.executable, "-m", "smp2ds.cli"]


def commands(config: str) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "python -c pass": [py, "-c", "pass"],
        "import jsonschema (floor)": [py, "-c", "import jsonschema"],
        "translator only (no CLI)": [py, "-c", TRANSLATOR_ONLY, config],
        "smp2ds convert": console_script() + ["convert", config],
        "python -m ...cli convert": [py, "-m", "smp2ds.cli", "convert", config],
        "import torch": [py, "-c", "import torch"],
    }


def bench_env(cold: bool) -> dict[str, str]:
    """Environment of the measured commands.

    By default byte-code caching is on, as for any installed package, with the caches in a
    private folder (``PYTHONPYCACHEPREFIX``) so nothing is written into the checkout. A session
    with ``PYTHONDONTWRITEBYTECODE=1`` would otherwise recompile every smp2ds module on each run
    while jsonschema's caches come from its wheel, an unfair floor. ``--cold`` keeps the
    caller's environment as it is.
    """
    env = dict(os.environ)
    if not cold:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "smp2ds-bench-pycache")
    return env


ENV: dict[str, str] = dict(os.environ)


def time_once(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system of the child) of one run of ``cmd``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False, env=ENV
    )
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu


def measure(cmds: dict[str, list[str]], runs: int) -> dict[str, list[tuple[float, float]]]:
    for cmd in cmds.values():  # warm the page cache and .pyc files once
        time_once(cmd)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            samples[name].append(time_once(cmd))
    return samples


def report(samples: dict[str, list[tuple[float, float]]]) -> float:
    """Print the table; return the wall-time ratio of convert to the jsonschema floor."""
    wall = {name: statistics.median(w for w, _ in values) for name, values in samples.items()}
    cpu = {name: statistics.median(c for _, c in values) for name, values in samples.items()}
    floor_name = "import jsonschema (floor)"
    print(
        f"{'command':<28} {'wall med s':>10} {'wall min s':>10} {'x floor':>8} {'cpu med s':>10} {'x floor':>8}"
    )
    for name, values in samples.items():
        print(
            f"{name:<28} {wall[name]:10.3f} {min(w for w, _ in values):10.3f} {wall[name] / wall[floor_name]:8.2f}"
            f" {cpu[name]:10.3f} {cpu[name] / cpu[floor_name]:8.2f}"
        )
    ratio = wall["smp2ds convert"] / wall[floor_name]
    cpu_ratio = cpu["smp2ds convert"] / cpu[floor_name]
    print(
        f"\nsmp2ds convert / import jsonschema: wall {ratio:.2f}, cpu {cpu_ratio:.2f} (target <= {TARGET}) "
        f"{'PASS' if ratio <= TARGET else 'FAIL'}"
    )
    print(f"import torch / smp2ds convert: wall {wall['import torch'] / wall['smp2ds convert']:.1f}")
    print(
        "(cpu = user+system seconds of the child; less sensitive than wall time to other load on the machine)"
    )
    return ratio


def import_profile(config: str, top: int) -> None:
    """Print the slowest cumulative imports of one convert run (``python -X importtime``)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "smp2ds.cli", "convert", config],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        own, cumulative, name = line.split(":", 1)[1].split("|", 2)
        rows.append((int(cumulative), int(own), name.rstrip()))
    heavy_roots = ("torch", "deepspeed", "transformers", "numpy", "jsonschema", "referencing")
    heavy = [r for r in rows if r[2].strip().split(".")[0] in heavy_roots]
    print(f"\nslowest imports of `convert` (cumulative microseconds, top {top}):")
    for cumulative, own, name in sorted(rows, reverse=True)[:top]:
        print(f"  {cumulative:>9}  {own:>8}  {name}")
    print("heavy modules imported:", ", ".join(sorted({r[2].strip() for r in heavy})) or "none")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="timed runs per command (median reported)")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="estimator JSON to convert")
    parser.add_argument("--importtime", action="store_true", help="also list the slowest imports of convert")
    parser.add_argument("--top", type=int, default=15, help="rows of the import profile")
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 when convert exceeds {TARGET}x the floor"
    )
    parser.add_argument(
        "--cold", action="store_true", help="keep the environment as is (e.g. PYTHONDONTWRITEBYTECODE=1)"
    )
    args = parser.parse_args(argv)
    ENV.clear()
    ENV.update(bench_env(args.cold))
    caching = (
        "as the caller's environment" if args.cold else "byte-code caches on (private PYTHONPYCACHEPREFIX)"
    )
    cmds = commands(args.config)
    print(
        f"{args.runs} runs each, interleaved; python {sys.version.split()[0]}; "
        f"config {os.path.relpath(args.config, ROOT)}; {caching}\n"
    )
    ratio = report(measure(cmds, args.runs))
    if args.importtime:
        import_profile(args.config, args.top)
    return 1 if args.check and ratio > TARGET else 0


if __name__ == "__main__":
    sys.exit(main())
