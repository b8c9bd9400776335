"""A plain Hugging Face ``Trainer`` script runs unchanged on the SMP path (issue 10, item 8).

``hf_trainer/train_clm.py`` uses only ``transformers.Trainer`` and ``TrainingArguments(use_cpu=True)``.
Launched with ``torchrun`` on 2 CPU ranks and the environment SageMaker sets for model
parallelism, transformers imports smp2ds's ``smdistributed``, calls ``smp.init()``, wraps the model
in ``smp.DistributedModel`` and trains through ``smp.step``; the same script launched as one plain
process (no SMP) is the reference. Both consume the same samples per optimizer step (the
per-device batch of the reference is the SMP run's global batch), so logged losses, gradient
norms (clipping at 1.0 is active on the first step), evaluation metrics (20 samples: uneven
over 2 data-parallel ranks, so the last batch is padded and must be trimmed) and the saved
weights must agree.

``hf_trainer/run_clm_smp_era.py`` is shaped like SMP's own HF Trainer example ``run_clm.py`` (4.x era,
``is_torch_tpu_available`` imported guarded: transformers' own up to 4.50), at data-parallel size 2 and as a
2-stage pipeline; it is held to the same standard. CI's dependency job runs this file at the floor (4.41.0), the
last 4.50.x, 4.57.6 and 5.x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests._dist import BASE_ENV
from tests.scripts.torchrun_launch import run_torchrun

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install smp2ds[hf])")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "hf_trainer" / "train_clm.py"
TIMEOUT_S = float(os.environ.get("SMP2DS_TEST_TIMEOUT", "400"))
SMP_ENV = {"SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True})}
GLOBAL_BATCH = 8


def _smp_run(out: Path, partitions: int, *extra: str, parameters: dict | None = None, world: int = 2,
             data_parallel: int | None = None) -> list[dict[str, Any]]:
    data_parallel = data_parallel or world // partitions
    return run_torchrun(SCRIPT, world, ["--output_dir", str(out), "--per_device_train_batch_size",
                                        str(GLOBAL_BATCH // data_parallel), *extra],
                        smp_parameters={"partitions": partitions, "microbatches": 2, "ddp": True, **(parameters or {})},
                        env=SMP_ENV, timeout_s=TIMEOUT_S)


def _plain_env(report_dir: Path) -> dict[str, str]:
    """A launch with no SageMaker environment (so no SMP path), the ranks' reports written to ``report_dir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM_")}
    env.update(BASE_ENV, SMP2DS_SCRIPT_OUT=str(report_dir), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same script as one plain process (no SMP environment), global batch per device."""
    out = tmp_path_factory.mktemp("reference")
    env = _plain_env(out)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--output_dir", str(out), "--per_device_train_batch_size",
                           str(GLOBAL_BATCH)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads((out / "rank0.json").read_text())
    result["weights"] = _weights(out / "final")
    return result


def _weights(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "model.safetensors"))


def _stable(metrics: dict) -> dict:
    """The metrics without the timings."""
    return {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}


def _train_logs(result: dict) -> list[dict]:
    return [h for h in result["log_history"] if "loss" in h]


def _assert_matches_reference(result: dict, ref: dict, weights: dict[str, np.ndarray], norms: bool = True) -> None:
    """``norms``: the Trainer logs gradient norms (under sharded data parallelism DeepSpeed clips inside its step,
    at ``sdp_gradient_clipping``, 1.0 as the script's ``max_grad_norm``, and the Trainer logs none)."""
    got, want = _train_logs(result), _train_logs(ref)
    assert [h["step"] for h in got] == [h["step"] for h in want] == [1, 2, 3, 4]
    assert want[0]["grad_norm"] > 1.0  # clipping is exercised
    np.testing.assert_allclose([h["loss"] for h in got], [h["loss"] for h in want], rtol=1e-5)
    if norms:
        np.testing.assert_allclose([h["grad_norm"] for h in got], [h["grad_norm"] for h in want], rtol=1e-4)
    np.testing.assert_allclose([h["learning_rate"] for h in got], [h["learning_rate"] for h in want], rtol=1e-6)
    metrics, ref_metrics = result["eval"], ref["eval"]
    assert metrics["eval_samples"] == ref_metrics["eval_samples"] == 20
    assert metrics["eval_labels_by_position"] == ref_metrics["eval_labels_by_position"]  # each sample once, in order
    for key in ("eval_loss", "eval_nll_mean", "eval_nll_by_position"):
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, err_msg=key)
    extra = sorted(set(weights) - set(ref["weights"]))
    # The pipeline's model is gathered from both stages, so the head tied to the token embedding
    # arrives as a separate (equal) tensor and is saved under its own name as well.
    assert extra in ([], ["lm_head.weight"]) and not set(ref["weights"]) - set(weights)
    if extra:
        np.testing.assert_array_equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    for key, value in ref["weights"].items():
        np.testing.assert_allclose(weights[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.fixture(scope="module")
def smp_data_parallel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """The script under smp2ds: partitions 1, ddp, 2 ranks (its output folder, each rank's report)."""
    out = tmp_path_factory.mktemp("smp_dp2") / "full"
    return out, _smp_run(out, 1)


def test_plain_trainer_script_data_parallel_with_resume(tmp_path: Path, reference: dict,
                                                        smp_data_parallel: tuple[Path, list[dict]]) -> None:
    """partitions 1, ddp, 2 ranks: training, evaluation (gathered over the data-parallel group)
    and save_model match the plain run; checkpoint-2 holds SMP's optimizer file; a second launch
    resuming from it restores model and Adam state (step counters 2 + 2) and ends on the same
    weights as the uninterrupted run."""
    folder, full = smp_data_parallel
    for rank, r in enumerate(full):
        assert (r["world_size"], r["process_index"], r["device"]) == (2, rank, "cpu")
        assert (r["model_class"], r["optimizer_class"]) == ("DistributedModel", "DistributedOptimizer")
        assert r["parallel_mode"].endswith("SAGEMAKER_MODEL_PARALLEL") and r["optimizer_steps"] == [4]
        assert _stable(r["eval"]) == _stable(full[0]["eval"])
    weights = _weights(folder / "final")
    _assert_matches_reference(full[0], reference, weights)
    assert "optimizer.pt_0_0.pt" in os.listdir(folder / "checkpoint-2")

    resumed = _smp_run(tmp_path / "resumed", 1, "--resume_from_checkpoint", str(folder / "checkpoint-2"))
    # steps 1-2 come with the checkpoint's trainer state, 3-4 are trained after the resume
    assert [h["step"] for h in _train_logs(resumed[0])] == [1, 2, 3, 4]
    np.testing.assert_allclose([h["loss"] for h in _train_logs(resumed[0])][2:],
                               [h["loss"] for h in _train_logs(reference)][2:], rtol=1e-5)
    assert all(r["optimizer_steps"] == [4] for r in resumed)  # a fresh optimizer would count 2
    for key, value in _weights(tmp_path / "resumed" / "final").items():
        np.testing.assert_allclose(value, weights[key], rtol=0, atol=1e-7, err_msg=key)


def test_plain_trainer_script_pipeline_parallel(tmp_path: Path, reference: dict) -> None:
    """partitions 2 on 2 ranks (one pipeline, data-parallel size 1): both stages read the same
    batches; losses, norms, evaluation and the saved (gathered) model match the plain run."""
    results = _smp_run(tmp_path / "pp", 2)
    for r in results:
        assert (r["world_size"], r["process_index"]) == (1, 0)
        assert (r["model_class"], r["optimizer_class"]) == ("DistributedModel", "DistributedOptimizer")
    _assert_matches_reference(results[0], reference, _weights(tmp_path / "pp" / "final"))
    assert sorted(n for n in os.listdir(tmp_path / "pp" / "checkpoint-2") if n.startswith("optimizer")) == [
        "optimizer.pt_0_0.pt", "optimizer.pt_1_0.pt"]


SHARDED = {
    # id: (world size, data-parallel size the Trainer shards its data over, SMP parameters)
    "sdp2": (2, 2, {"sharded_data_parallel_degree": 2}),
    # the tensor-parallel pair shares its batch (prescaled_batch, SMP's rule with sdp): 2 data-parallel parts
    "tp2-sdp2": (4, 2, {"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True}),
}


@pytest.mark.parametrize("layout", list(SHARDED))
def test_trainer_checkpoints_and_resumes_under_sharded_data_parallelism(tmp_path: Path, reference: dict,
                                                                        layout: str) -> None:
    """The Trainer saves SMP optimizer state with ``smp.save(..., v3=smp.state.cfg.shard_optimizer_state)`` on
    rdp rank 0 only unless that flag is set. Under sharded data parallelism the state is sharded, so the flag
    reads True: every rdp rank writes its part, and a second launch resuming from checkpoint-2 continues like
    the uninterrupted run (losses of steps 3-4, Adam step counters, final weights). The uninterrupted run
    itself trains like the plain single-process run."""
    world, data_parallel, parameters = SHARDED[layout]
    run = {"parameters": parameters, "world": world, "data_parallel": data_parallel}
    full = _smp_run(tmp_path / "full", 1, **run)
    weights = _weights(tmp_path / "full" / "final")
    _assert_matches_reference(full[0], reference, weights, norms=False)
    parts = sorted(n for n in os.listdir(tmp_path / "full" / "checkpoint-2") if n.startswith("optimizer"))
    rdp = world // parameters.get("tensor_parallel_degree", 1)
    assert parts == sorted(f"optimizer.pt_0_{tp}_{r}.pt" for tp in range(world // rdp) for r in range(rdp))

    resumed = _smp_run(tmp_path / "resumed", 1, "--resume_from_checkpoint", str(tmp_path / "full" / "checkpoint-2"),
                       **run)
    assert [h["step"] for h in _train_logs(resumed[0])] == [1, 2, 3, 4]
    np.testing.assert_allclose([h["loss"] for h in _train_logs(resumed[0])][2:],
                               [h["loss"] for h in _train_logs(full[0])][2:], rtol=1e-6)
    assert all(r["optimizer_steps"] == [4] for r in resumed)  # a fresh optimizer would count 2
    for key, value in _weights(tmp_path / "resumed" / "final").items():
        np.testing.assert_allclose(value, weights[key], rtol=0, atol=1e-7, err_msg=key)


# ---- leaving SMP: the same script under accelerate, with the config `convert --to accelerate --trainer` wrote ----
ACCELERATE_LAYOUTS = {
    # id: (SMP parameters, the DeepSpeed ZeRO stage the converted config runs)
    "dp2": ({}, 0),
    "dp2-shard-optimizer-state": ({"shard_optimizer_state": True}, 1),
}


@pytest.mark.parametrize("layout", list(ACCELERATE_LAYOUTS))
def test_trainer_script_under_accelerate_with_the_converted_config_trains_as_under_smp(
        tmp_path: Path, reference: dict, smp_data_parallel: tuple[Path, list[dict]], layout: str) -> None:
    """A team leaving SMP converts its job (``convert --to accelerate --trainer`` on 2 ranks) and runs the same
    Trainer script with ``accelerate launch --config_file``, with no SMP environment and no smp2ds import: the
    Trainer accepts the DeepSpeed JSON (its batch, accumulation and clipping "auto", filled from the script's
    arguments, clipping at 1.0 active on step 1), DeepSpeed runs the ZeRO stage SMP asked for on 2 data-parallel
    ranks, and the losses, learning rates, evaluation and saved model equal the plain single-process run and the
    losses the run under smp2ds. DeepSpeed clips inside its step, so the Trainer logs no gradient norms."""
    parameters, stage = ACCELERATE_LAYOUTS[layout]
    smp_params = tmp_path / "smp_parameters.json"
    smp_params.write_text(json.dumps({"partitions": 1, "microbatches": 2, "ddp": True, **parameters}))
    config = tmp_path / "run.yaml"
    from smp2ds.cli import main

    assert main(["convert", str(smp_params), "--to", "accelerate", "--trainer", "--world-size", "2",
                 "-o", str(config)]) == 0
    deepspeed_json = json.loads((tmp_path / "run.deepspeed.json").read_text())
    assert deepspeed_json["zero_optimization"]["stage"] == stage
    assert {deepspeed_json[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                        "gradient_accumulation_steps", "gradient_clipping")} == {"auto"}

    out = tmp_path / "accelerate"
    env = _plain_env(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           str(SCRIPT), "--output_dir", str(out), "--per_device_train_batch_size",
                           str(GLOBAL_BATCH // 2)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, r in enumerate(ranks):
        assert (r["world_size"], r["process_index"], r["model_class"]) == (2, rank, "DeepSpeedEngine")
        assert r["parallel_mode"] == "ParallelMode.DISTRIBUTED" and r["optimizer_steps"] == [4]
        assert r["smp_imported"] == []  # neither smdistributed nor smp2ds was imported
    assert smp_data_parallel[1][0]["smp_imported"] == ["smdistributed", "smp2ds"]  # the check can see them
    _assert_matches_reference(ranks[0], reference, _weights(out / "final"), norms=False)
    smp_logs = _train_logs(smp_data_parallel[1][0])
    np.testing.assert_allclose([h["loss"] for h in _train_logs(ranks[0])], [h["loss"] for h in smp_logs], rtol=1e-5)


# ---- an SMP-era run_clm.py ---------------------------------------------------------------------
RUN_CLM = Path(__file__).parent / "hf_trainer" / "run_clm_smp_era.py"
RUN_CLM_ARGS = [
    "--model_type", "gpt2", "--config_overrides",
    "n_embd=32,n_layer=2,n_head=2,vocab_size=64,n_positions=16,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0,"
    "bos_token_id=63,eos_token_id=63",
    "--do_train", "--do_eval", "--per_device_eval_batch_size", "4", "--max_steps", "4", "--learning_rate", "1e-2",
    "--adam_epsilon", "1e-4", "--max_grad_norm", "1.0", "--logging_steps", "1", "--save_strategy", "no",
    "--seed", "0", "--report_to", "none", "--use_cpu", "--dataloader_pin_memory", "False", "--disable_tqdm", "True",
]


def _run_clm_outputs(out: Path) -> dict[str, Any]:
    """What run_clm.py itself wrote on its main process: metrics, trainer state and the model."""
    return {"results": json.loads((out / "all_results.json").read_text()),
            "logs": _train_logs(json.loads((out / "trainer_state.json").read_text())),
            "weights": _weights(out)}


@pytest.fixture(scope="module")
def run_clm_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """run_clm.py as one plain process (no SMP environment) with the global batch."""
    out = tmp_path_factory.mktemp("run_clm_plain")
    env = _plain_env(out)
    plain = subprocess.run([sys.executable, str(RUN_CLM), *RUN_CLM_ARGS, "--output_dir", str(out / "plain"),
                            "--per_device_train_batch_size", str(GLOBAL_BATCH)],
                           env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert plain.returncode == 0, plain.stderr[-6000:]
    return _run_clm_outputs(out / "plain")


def _expected_tpu_check() -> str:
    """The check run_clm.py ends up calling: transformers' own ``is_torch_tpu_available`` where the release still
    has it (up to 4.50), else the script's fallback to the renamed ``is_torch_xla_available``."""
    import transformers

    return "is_torch_tpu_available" if hasattr(transformers, "is_torch_tpu_available") else "is_torch_xla_available"


@pytest.mark.parametrize("partitions", [1, 2], ids=["dp2", "pp2"])
def test_smp_era_run_clm_script_runs_unchanged_and_matches_the_plain_run(tmp_path: Path, run_clm_reference: dict,
                                                                         partitions: int) -> None:
    """A script shaped like SMP's HF Trainer example run_clm.py (HfArgumentParser, CONFIG_MAPPING +
    --config_overrides, group_texts, is_torch_tpu_available imported guarded, save_model / save_metrics /
    save_state, perplexity), on 2 ranks with ddp and partitions 1 (data-parallel size 2) or partitions 2 (one
    pipeline of 2 stages reading the same batches), against the same script as one plain process with the
    global batch: it takes the SMP path (DistributedModel, SAGEMAKER_MODEL_PARALLEL), and the losses and
    gradient norms it logs (clipping active on step 1), its evaluation (20 blocks: each counted once) and the
    model it saves match the plain run."""
    ref = run_clm_reference
    data_parallel = 2 // partitions
    ranks = run_torchrun(RUN_CLM, 2, [*RUN_CLM_ARGS, "--output_dir", str(tmp_path / "smp"),
                                      "--per_device_train_batch_size", str(GLOBAL_BATCH // data_parallel)],
                         smp_parameters={"partitions": partitions, "microbatches": 2, "ddp": True}, env=SMP_ENV,
                         timeout_s=TIMEOUT_S)
    for r in ranks:
        assert r["parallel_mode"].endswith("SAGEMAKER_MODEL_PARALLEL") and r["world_size"] == data_parallel
        assert (r["model_class"], r["tpu_check"]) == ("DistributedModel", _expected_tpu_check())
    got = _run_clm_outputs(tmp_path / "smp")

    assert [h["step"] for h in got["logs"]] == [h["step"] for h in ref["logs"]] == [1, 2, 3, 4]
    assert ref["logs"][0]["grad_norm"] > 1.0  # clipping is exercised
    np.testing.assert_allclose([h["loss"] for h in got["logs"]], [h["loss"] for h in ref["logs"]], rtol=1e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in got["logs"]], [h["grad_norm"] for h in ref["logs"]],
                               rtol=1e-4)
    results, want = got["results"], ref["results"]
    assert results["eval_samples"] == want["eval_samples"] == 20
    # the argmax predictions of all 140 shifted tokens: each block gathered exactly once
    assert results["eval_predictions_checksum"] == want["eval_predictions_checksum"]
    for key in ("eval_loss", "eval_accuracy", "perplexity", "train_loss"):
        np.testing.assert_allclose(results[key], want[key], rtol=1e-5, err_msg=key)
    extra = sorted(set(got["weights"]) - set(ref["weights"]))
    # the pipeline's model is gathered from both stages: the head tied to the token embedding may arrive as a
    # separate (equal) tensor saved under its own name
    assert extra in ([], ["lm_head.weight"]) and not set(ref["weights"]) - set(got["weights"])
    if extra:
        np.testing.assert_array_equal(got["weights"]["lm_head.weight"], got["weights"]["transformer.wte.weight"])
    for key, value in ref["weights"].items():
        np.testing.assert_allclose(got["weights"][key], value, rtol=1e-4, atol=1e-6, err_msg=key)
