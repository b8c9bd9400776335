"""``smp2ds explain --model``: the pipeline split DistributedModel would choose, from a config."""

from __future__ import annotations

import json
from pathlib import Path

from smp2ds.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"


def _gpt2_config(path: Path, layers: int = 4) -> str:
    from transformers import GPT2Config

    config = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=1000, n_positions=64).to_dict()
    config["architectures"] = ["GPT2LMHeadModel"]
    path.write_text(json.dumps(config))
    return str(path)


def test_split_equals_the_one_the_engine_computes_for_the_real_model(tmp_path, capsys):
    model_json = _gpt2_config(tmp_path / "config.json")
    smp = tmp_path / "smp.json"
    smp.write_text(json.dumps({"partitions": 2, "ddp": True, "memory_weight": 0.3, "microbatches": 4}))
    code = main(["explain", str(smp), "--world-size", "2", "--model", model_json, "--format", "json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    split = out["pipeline_split"]
    # The same split the engine computes for a real (weights on CPU) model of that config.
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from smp2ds.engine.pipeline import build_layer_list, plan_partition

    torch.manual_seed(0)
    real = GPT2LMHeadModel(GPT2Config.from_json_file(model_json))
    expected = plan_partition(build_layer_list(real), 2, memory_weight=0.3)
    assert split["parts"] == list(expected.parts)
    assert [s["layers"] for s in split["stages"]] == [list(s.layers) for s in expected.stages]
    assert split["stages"][0]["layers"][0] == "transformer.wte" and split["stages"][-1]["layers"][-1] == "lm_head"
    # Without --params the estimate uses the model's own (tied weights counted once) size.
    assert out["estimate"]["n_params_source"] == "--model"
    assert out["model"] == "GPT2LMHeadModel"
    assert out["estimate"]["n_params"] == sum(p.numel() for p in real.parameters())


def test_memory_weight_changes_the_split(tmp_path, capsys):
    model_json = _gpt2_config(tmp_path / "config.json", layers=6)
    splits = []
    for weight in (0.0, 1.0):
        smp = tmp_path / f"smp{weight}.json"
        smp.write_text(json.dumps({"partitions": 2, "ddp": True, "memory_weight": weight}))
        assert main(["explain", str(smp), "--world-size", "2", "--model", model_json, "--format", "json"]) == 0
        splits.append(json.loads(capsys.readouterr().out)["pipeline_split"]["parts"])
    assert splits[0] != splits[1]


def test_text_output_names_each_stage(tmp_path, capsys):
    model_json = _gpt2_config(tmp_path / "config.json")
    code = main(["explain", str(EXAMPLES / "bert_pipeline_000.json"), "--model", model_json])
    out = capsys.readouterr().out
    assert code == 0
    from transformers import GPT2Config, GPT2LMHeadModel

    n = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config.from_json_file(model_json)).parameters())
    assert f"pipeline split of GPT2LMHeadModel ({n:,} parameters) into 2 stage(s), auto, memory_weight 0.3:" in out
    assert "stage 0: layers 0-" in out and "stage 1: layers" in out and "lm_head]" in out


def test_unsupported_architecture_is_a_usage_error_naming_the_supported_ones(tmp_path, capsys):
    bad = tmp_path / "bart.json"
    bad.write_text(json.dumps({"model_type": "bart", "architectures": ["BartForConditionalGeneration"]}))
    code = main(["explain", str(EXAMPLES / "bert_pipeline_000.json"), "--model", str(bad)])
    err = capsys.readouterr().err
    assert code == 2
    assert "'BartForConditionalGeneration' has no pipeline layer list" in err
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err and "Traceback" not in err


def test_tensor_parallel_traffic_for_the_model_config(tmp_path, capsys):
    # Megatron by hand: per-rank batch 8 in 2 micro-batches of 4; prescaled_batch false joins the
    # two tensor-parallel ranks' micro-batches (layer batch 8); 4 all-reduces per layer and
    # micro-batch of 8 x 32 (seq) x 64 (hidden) fp32 elements: 4 * 8*32*64*4 B * 2 = 524,288 B per
    # layer and step; a ring over 2 ranks moves 2 * 1/2 of that per rank, x 3 layers.
    model_json = _gpt2_config(tmp_path / "config.json", layers=3)
    smp = tmp_path / "smp.json"
    smp.write_text(json.dumps({"tensor_parallel_degree": 2, "ddp": True, "microbatches": 2}))
    argv = ["explain", str(smp), "--world-size", "4", "--batch-size", "8", "--model", model_json, "--seq-len", "32"]
    assert main([*argv, "--format", "json"]) == 0
    traffic = json.loads(capsys.readouterr().out)["tensor_parallel_traffic"]
    assert traffic["layer_batch"] == 8 and traffic["all_reduces_per_layer_and_step"] == 8
    assert traffic["all_reduce_buffer_bytes_per_layer_and_step"] == 524_288
    assert traffic["ring_bytes_per_rank_per_step"] == 3 * 524_288
    smp.write_text(json.dumps({"tensor_parallel_degree": 2, "ddp": True, "microbatches": 2, "prescaled_batch": True}))
    assert main([*argv, "--format", "json"]) == 0
    shared = json.loads(capsys.readouterr().out)["tensor_parallel_traffic"]
    assert shared["layer_batch"] == 4 and shared["all_reduce_buffer_bytes_per_layer_and_step"] == 262_144
    assert main(argv) == 0
    assert "tensor-parallel traffic (Megatron: 8 all-reduces per layer and step over 2 ranks" in capsys.readouterr().out
    # without the batch there is nothing to compute: a usage error naming the flag
    assert main(argv[:4] + argv[6:]) == 2
    assert "needs --batch-size" in capsys.readouterr().err


def test_tensor_parallel_traffic_refuses_sizes_that_do_not_fit():
    import pytest

    from smp2ds.translator.tools.tp_traffic import tensor_parallel_traffic

    args = dict(tp=2, layers=2, hidden=64, seq_len=32, batch_per_rank=6, microbatches=4, bytes_per_element=4,
                prescaled_batch=True)
    with pytest.raises(ValueError, match=r"batch_per_rank\(6\) is not divisible by microbatches\(4\)"):
        tensor_parallel_traffic(**args)
    with pytest.raises(ValueError, match=r"positive integers, got tp=0, hidden=-1"):
        tensor_parallel_traffic(**{**args, "tp": 0, "hidden": -1, "batch_per_rank": 8})
