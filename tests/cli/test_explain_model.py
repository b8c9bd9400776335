"""``smp2ds explain --model``: the pipeline split DistributedModel would choose, from a config."""

from __future__ import annotations

import json
from pathlib import Path

from smp2ds.translator.cli import main

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
    bad = tmp_path / "t5.json"
    bad.write_text(json.dumps({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}))
    code = main(["explain", str(EXAMPLES / "bert_pipeline_000.json"), "--model", str(bad)])
    err = capsys.readouterr().err
    assert code == 2
    assert "'T5ForConditionalGeneration' has no pipeline layer list" in err
    assert "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err and "Traceback" not in err
