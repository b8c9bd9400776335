"""``smp2ds explain --memory`` and ``--fit``: the per-role peak, the verdict, the layouts that fit, and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smp2ds.cli import main

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4,
        "vocab_size": 1000, "n_positions": 64}


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(GPT2))
    smp = tmp_path / "smp.json"
    smp.write_text(json.dumps({"pipeline_parallel_degree": 2, "partitions": 2, "microbatches": 2, "ddp": True}))
    return str(smp), str(tmp_path / "model")


def test_memory_prints_each_stage_and_the_verdict(files, capsys):
    smp, model = files
    argv = ["explain", smp, "--model", model, "--memory", "--world-size", "2", "--batch-size", "4"]
    assert main([*argv, "--gpu-memory", "64MiB"]) == 0
    text = capsys.readouterr().out
    assert "stage 0" in text and "stage 1" in text and "micro-batch 2 x 64 tokens" in text
    assert "sequence from the model's maximum positions" in text and "does NOT fit on 64MiB" in text
    assert main([*argv, "--gpu-memory", "80GiB", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["micro_batches_in_flight"] for r in report["roles"]] == [2, 1]
    assert report["device"]["fits"] is True and report["peak"] == max(r["total"] for r in report["roles"])
    assert {f["name"] for f in report["roles"][0]["formulas"]} == {"Adam moments", "all-reduce bucket"}
    assert report["batch_source"] == "--batch-size" and report["not_counted"] == []
    # every phase's total, the peak the largest (no reduce-scatter phase without ZeRO-3)
    assert all(r["total"] == max(r["phases"].values()) and r["phases"]["reduce"] == 0 for r in report["roles"])
    assert main(argv) == 0
    assert "each phase's total" in capsys.readouterr().out


def test_what_the_estimate_does_not_model_is_said(tmp_path, files, capsys):
    """SMP's 175B seed configuration offloads activations: the estimate counts them on the device and says so."""
    _, model = files
    smp = tmp_path / "offload.json"
    smp.write_text(json.dumps({"pipeline_parallel_degree": 2, "microbatches": 2, "ddp": True,
                               "offload_activations": True}))
    argv = ["explain", str(smp), "--model", model, "--memory", "--world-size", "2", "--batch-size", "4"]
    assert main(argv) == 0
    assert "not modelled: offload_activations" in capsys.readouterr().out
    assert main([*argv, "--format", "json"]) == 0
    [line] = json.loads(capsys.readouterr().out)["not_counted"]
    assert line.startswith("offload_activations: ") and "upper bound" in line


def test_sequence_and_batch_come_from_the_estimators_hyperparameters(tmp_path, files, capsys):
    _, model = files
    estimator = tmp_path / "estimator.json"
    estimator.write_text(json.dumps({"hyperparameters": {"max_context_width": 32, "train_batch_size": 2},
                                     "distribution": {"mpi": {"enabled": True, "processes_per_host": 1},
                                                      "smdistributed": {"modelparallel": {
                                                          "enabled": True,
                                                          "parameters": {"ddp": True, "microbatches": 1}}}}}))
    assert main(["explain", str(estimator), "--model", model, "--memory", "--world-size", "1",
                 "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["seq_len"] == 32 and report["seq_len_source"] == "hyperparameters.max_context_width"
    assert report["batch_per_rank"] == 2 and report["batch_source"] == "hyperparameters.train_batch_size"


def test_fit_proposes_layouts_that_fit_fastest_per_sample_first(files, capsys):
    """A model that fits one device with room to spare: plain data parallelism comes first (a pipeline idles in its
    bubble and a tensor-parallel group spends two ranks on one replica), each layout with its step-time terms."""
    smp, model = files
    argv = ["explain", smp, "--model", model, "--world-size", "2", "--batch-size", "4", "--seq-len", "64"]
    assert main([*argv, "--fit", "3GiB", "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["fitting"] and found["layouts_tried"] >= len(found["fitting"])
    assert all(item["peak"] <= found["usable_bytes"] for item in found["fitting"])
    per_sample = [item["step_time"]["seconds_per_sample"] for item in found["fitting"]]
    assert per_sample == sorted(per_sample)
    best = found["fitting"][0]
    assert (best["smp_parameters"]["pipeline_parallel_degree"], best["smp_parameters"]["tensor_parallel_degree"],
            best["activation_checkpointing"]) == (1, 1, False)
    assert best["step_time"]["samples_per_step"] == 2 * 4
    piped = [i for i in found["fitting"] if i["smp_parameters"]["pipeline_parallel_degree"] == 2]
    assert all(i["step_time"]["terms"]["pipeline bubble"] > 0 for i in piped)
    # for users leaving SMP: the first layout as a native DeepSpeed config, what `convert --native` writes for it
    native = found["native_deepspeed"]["config"]
    assert native["train_micro_batch_size_per_gpu"] * native["gradient_accumulation_steps"] == 4
    assert native["zero_optimization"]["stage"] == 0 and "tensor_parallel" not in native
    # ZeRO-1's 5e8-element bucket (about 1.9 GiB in fp32) does not fit a 1.5 GiB device: only DDP layouts remain
    assert main([*argv, "--fit", "1.5GiB", "--format", "json"]) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["fitting"] and not any(i["smp_parameters"].get("shard_optimizer_state") for i in small["fitting"])
    assert main([*argv, "--fit", "1MiB"]) == 0
    assert "none fits" in capsys.readouterr().out


def test_memory_sizes_sharded_data_parallelism(tmp_path, files, capsys):
    _, model = files
    smp = tmp_path / "sdp.json"
    smp.write_text(json.dumps({"sharded_data_parallel_degree": 2, "microbatches": 2, "ddp": True}))
    argv = ["explain", str(smp), "--model", model, "--memory", "--world-size", "4", "--batch-size", "4"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fp32 master partition" in text and "[update only]" in text and "gathered parameters" in text
    assert main([*argv, "--format", "json"]) == 0
    role = json.loads(capsys.readouterr().out)["roles"][0]
    assert {f["name"] for f in role["formulas"]} >= {"Adam moments", "reduce bucket", "replica all-reduce copy"}
    assert role["peak_phase"] in ("backward", "reduce", "update")
    # ZeRO-3's phases each have a total: forward and backward (activations), the last reduce-scatter, the update
    assert all(value > 0 for value in role["phases"].values()) and role["total"] == max(role["phases"].values())


@pytest.mark.parametrize("extra,message", [
    (["--memory"], "--memory needs --model"),
    (["--memory", "--model", "MODEL"], "--memory needs the per-rank batch"),
    (["--memory", "--model", "MODEL", "--batch-size", "4", "--gpu-memory", "tpu"], "known GPU"),
    (["--memory", "--model", "nowhere:build", "--batch-size", "4"], "cannot load"),
])
def test_mistakes_are_usage_errors_naming_the_flag(files, capsys, extra, message):
    smp, model = files
    argv = ["explain", smp, "--world-size", "2", *[model if a == "MODEL" else a for a in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_validate_warns_when_a_step_does_not_fit_the_device(files, capsys, monkeypatch):
    smp, model = files
    monkeypatch.delenv("SMP2DS_GPU_MEMORY", raising=False)
    argv = ["validate", smp, "--world-size", "2", "--batch-size", "4", "--model", model]
    assert main([*argv, "--gpu-memory", "64MiB"]) == 0  # still valid: the layout runs, on a bigger device
    out = capsys.readouterr().out
    assert "warning: one training step does not fit: peak" in out and "--fit SIZE" in out
    assert main([*argv, "--gpu-memory", "80GiB", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memory"].startswith("fits: peak") and not report["warnings"]
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi: no visible GPU to compare with
    assert main(argv) == 2
    assert "no GPU is visible here; pass --gpu-memory" in capsys.readouterr().err


def test_doctor_checks_the_step_against_the_visible_gpu(files, capsys, monkeypatch):
    smp, model = files
    monkeypatch.setenv("SMP2DS_NUM_GPUS", "2")
    argv = ["doctor", "--config", smp, "--world-size", "2", "--model", model, "--batch-size", "4", "--format", "json"]
    monkeypatch.setenv("SMP2DS_GPU_MEMORY", "64MiB")
    main(argv)
    memory = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["check"] == "memory"]
    assert memory and memory[0]["status"] == "warn" and "does not fit" in memory[0]["detail"]
    assert "--fit SIZE" in memory[0]["fix"]
    monkeypatch.setenv("SMP2DS_GPU_MEMORY", "80GiB")
    main(argv)
    memory = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["check"] == "memory"]
    assert memory[0]["status"] == "ok" and "SMP2DS_GPU_MEMORY" in memory[0]["detail"]
    monkeypatch.delenv("SMP2DS_GPU_MEMORY")
    monkeypatch.setenv("PATH", "/nonexistent")
    main(argv)
    memory = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["check"] == "memory"]
    assert memory[0]["status"] == "info" and "no GPU visible" in memory[0]["detail"]


def test_fit_skips_layouts_the_model_cannot_take_and_names_why(tmp_path, capsys):
    """A LLaMA with 2 key/value heads at 4 ranks: tensor-parallel degree 4 does not divide them. Such a candidate
    used to end --fit with an internal error; it is skipped, with the engine's reason, and the rest is ranked."""
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500,
        "max_position_embeddings": 64}))
    smp = tmp_path / "smp.json"
    smp.write_text(json.dumps({"ddp": True, "tensor_parallel_degree": 2}))
    argv = ["explain", str(smp), "--model", str(tmp_path / "llama"), "--world-size", "4", "--batch-size", "2",
            "--seq-len", "32", "--fit", "8GiB"]
    assert main([*argv, "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    reasons = [s["reason"] for s in found["skipped"] if s["smp_parameters"].get("tensor_parallel_degree") == 4]
    assert reasons and "must divide" in reasons[0] and "num_key_value_heads=2" in reasons[0]
    assert found["fitting"] and all(i["smp_parameters"].get("tensor_parallel_degree", 1) != 4
                                    for i in found["fitting"])
    assert main(argv) == 0
    assert "skipped " in capsys.readouterr().out
