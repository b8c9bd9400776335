"""``bench/gpu_check.py``'s own logic, fast (the whole CPU run is in ``.ci/run``): a GPT-2 script whose
losses leave native DeepSpeed's is failed, the step-time ratios and the same-config note come from the
runners' results, and the no-install path makes ``smp2ds`` importable from the checkout alone."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def gpu_check():
    return _load("gpu_check")


def _row(name: str, losses: list[float]) -> dict:
    return {"name": name, "status": "ok", "detail": "d", "losses": losses}


@pytest.mark.parametrize("drift,status", [(5e-4, "ok"), (5e-3, "failed")])
def test_gpt2_script_is_held_to_native_deepspeed(gpu_check, drift, status):
    native = _row("GPT-2, native DeepSpeed bf16", [5.0, 4.0, 3.0])
    script = _row("GPT-2, HF model kept bf16", [5.0, 4.0 * (1 + drift), 3.0])
    other_precision = _row("GPT-2, HF model kept fp16", [9.0, 9.0, 9.0])  # no fp16 native row: left alone
    gpu_check.hold_to_deepspeed([native, script, other_precision])
    assert script["status"] == status
    assert ("differ from native DeepSpeed" in script["detail"]) == (status == "failed")
    assert native["status"] == "ok" and other_precision["status"] == "ok"


def test_timing_rows_ratio_and_config_note(gpu_check):
    def result(median, best, config):
        return {"status": "ok", "median_s": median, "best_s": best, "steps": 8, "loss": 1.0, "ds_config": config}

    results = {"plain": result(0.07, 0.06, None), "deepspeed": result(0.08, 0.07, {"bf16": 1}),
               "smp2ds": result(0.1, 0.077, {"bf16": 2})}
    rows = gpu_check.timing_rows(results, "124M", "bf16")
    assert [round(r["ratio"], 3) for r in rows] == [0.875, 1.0, 1.25]
    assert round(rows[2]["best_ratio"], 3) == 1.1
    assert "DeepSpeed config DIFFERS from native" in rows[2]["detail"]


def test_distributed_transformer_row_is_compared_with_the_kept_model(gpu_check):
    def result(median):
        return {"status": "ok", "median_s": median, "best_s": median, "steps": 8, "loss": 1.0, "ds_config": None}

    results = {"plain": result(1.0), "deepspeed": result(1.0), "smp2ds": result(1.0), "smp2ds_dt": result(0.9),
               "deepspeed_compile": result(0.8), "smp2ds_compile": result(0.8)}
    rows = gpu_check.timing_rows(results, "124M", "bf16")
    assert [r["name"] if "name" in r else None for r in rows] == [None] * 6
    assert [round(r["ratio"], 2) for r in rows] == [1.0, 1.0, 1.0, 0.9, 0.8, 0.8]
    assert "0.900x the kept HF model (SDPA), target <= 1.00" in rows[3]["detail"]
    assert set(gpu_check.RUNNERS) == set(results)


def test_failed_runner_has_no_ratio(gpu_check):
    results = {"plain": {"status": "ok", "median_s": 1.0, "best_s": 1.0, "steps": 1, "loss": 1.0},
               "deepspeed": {"status": "failed", "detail": "exit 1"},
               "smp2ds": {"status": "ok", "median_s": 1.0, "best_s": 1.0, "steps": 1, "loss": 1.0}}
    rows = gpu_check.timing_rows(results, "tiny", "bf16")
    assert all("ratio" not in r for r in rows)


def test_rounds_combine_to_median_of_medians_and_best_of_all(gpu_check):
    def run(median, best, loss):
        return {"status": "ok", "median_s": median, "best_s": best, "steps": 30, "loss": loss, "peak_gib": 6.4}

    combined = gpu_check.combine_rounds([run(0.103, 0.08, 7.9), run(0.0877, 0.079, 8.1), run(0.0828, 0.081, 8.0)])
    assert combined["median_s"] == 0.0877 and combined["best_s"] == 0.079
    assert "round medians ms 103.0 87.7 82.8" in combined["suspects"]
    assert "losses of later rounds 8.1000 8.0000" in combined["suspects"]
    failed = {"status": "failed", "detail": "exit 1"}
    assert gpu_check.combine_rounds([run(0.1, 0.1, 1.0), failed]) is failed
    single = run(0.1, 0.09, 1.0)
    assert gpu_check.combine_rounds([single]) is single


def test_link_farm_imports_smp2ds_without_site_packages(tmp_path):
    """The bare-image path: with ``-S`` (no site-packages, so no installed smp2ds) the folder of links on
    PYTHONPATH alone provides ``smp2ds.translator`` and ``smdistributed`` from this checkout."""
    wheels = _load("gpu_check_wheels")
    farm = wheels._link_farm()
    code = ("import smp2ds.translator as t, smdistributed, os; "
            "print(os.path.realpath(t.__file__)); print(os.path.realpath(smdistributed.__file__))")
    out = subprocess.run([sys.executable, "-S", "-c", code], env={**os.environ, "PYTHONPATH": str(farm)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    root = str(BENCH.parent)
    assert out.stdout.split() == [f"{root}/translator/__init__.py", f"{root}/smdistributed/__init__.py"]


def test_step_profile_ranks_operators_by_difference_including_ones_only_one_runner_ran():
    step_profile = _load("step_profile")

    def op(name, ms, calls):
        return {"name": name, "device_ms": ms, "host_ms": 0.0, "calls": calls}

    ops = {"deepspeed": [op("mm", 19.4, 99), op("copy_", 3.9, 599), op("only_ds", 0.2, 1)],
           "smp2ds": [op("mm", 19.5, 99), op("copy_", 5.1, 600), op("only_smp", 0.5, 2)]}
    rows = step_profile.difference(ops, "device_ms", top=3)
    assert [r[0] for r in rows] == ["copy_", "only_smp", "only_ds"]
    assert rows[1][1:] == (0.0, 0.5, 0.0, 2)
    assert rows[0][4] == 600
