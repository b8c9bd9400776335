"""``convert --to deepspeed --native``: a plain DeepSpeed script's config at the job's layout, differences named.

The run that proves such a config trains like SMP is in ``tests/engine/checkpoint_tools/test_checkpoint_export_universal.py``; here
each mapping and each refusal (with the route that works) is checked on the printed config.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smp2ds.cli import main


def _native(tmp_path: Path, params: dict, capsys: pytest.CaptureFixture, *flags: str) -> tuple[int, str, str]:
    source = tmp_path / "smp.json"
    source.write_text(json.dumps(params), encoding="utf-8")
    code = main(["convert", str(source), "--to", "deepspeed", "--native", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_sharded_data_parallelism_with_replicas_is_zero3_with_hpz_and_says_what_differs(tmp_path, capsys):
    code, out, err = _native(tmp_path, {"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": 2}, capsys,
                             "--world-size", "8", "--batch-size", "4")
    assert code == 0
    config = json.loads(out)
    assert config["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 2}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 2)
    assert config["train_batch_size"] == 2 * 2 * 8  # over DeepSpeed's data-parallel size: every rank, not a group
    assert "gradients and optimizer state sharded over all 8" in err


def test_tensor_parallelism_is_autotp_and_the_group_feeds_its_ranks_rows(tmp_path, capsys):
    code, out, err = _native(tmp_path, {"ddp": True, "tensor_parallel_degree": 2}, capsys, "--world-size", "4",
                             "--batch-size", "3", "--model-type", "llama")
    assert code == 0
    config = json.loads(out)
    assert config["tensor_parallel"] == {"autotp_size": 2}
    # tp x B rows per rank; DeepSpeed's batch check counts all 4 ranks with AutoTP from the config (the exit
    # matrix's AutoTP continuation runs this config unchanged)
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (6, 24)
    assert "each tensor-parallel group feeds 6 identical rows" in err
    code, out, _ = _native(tmp_path, {"ddp": True, "tensor_parallel_degree": 2, "prescaled_batch": True}, capsys,
                           "--world-size", "4", "--batch-size", "3")
    assert code == 0 and json.loads(out)["train_micro_batch_size_per_gpu"] == 3  # the group shares one batch


@pytest.mark.parametrize(("params", "flags", "message"), [
    ({"ddp": True, "tensor_parallel_degree": 2}, ["--model-type", "gpt2"],
     "/tensor_parallel_degree: tensor_parallel_degree 2: DeepSpeed's AutoTP refuses the gpt2 family"),
    ({"ddp": True, "pipeline_parallel_degree": 2, "microbatches": 2}, [],
     "/pipeline_parallel_degree: pipeline_parallel_degree 2: a plain DeepSpeed script runs pipelines only"),
], ids=["autotp-family", "pipeline"])
def test_what_native_deepspeed_cannot_run_is_refused_with_the_route(tmp_path, capsys, params, flags, message):
    code, out, err = _native(tmp_path, params, capsys, "--world-size", "4", "--batch-size", "4", *flags)
    assert code == 1 and out == "" and message in err and "hint:" in err


def test_the_batch_is_needed_and_the_flags_belong_to_deepspeed(tmp_path, capsys):
    code, _, err = _native(tmp_path, {"ddp": True}, capsys, "--world-size", "2")
    assert code == 1 and "give --batch-size B" in err
    source = tmp_path / "smp.json"
    assert main(["convert", str(source), "--to", "torchrun", "--native"]) == 2
    assert "use them with --to deepspeed" in capsys.readouterr().err


def test_trainer_mode_leaves_the_trainers_keys_auto_and_needs_no_batch(tmp_path, capsys):
    """``--trainer``: the keys a Hugging Face Trainer fills from its arguments are "auto" (no --batch-size needed);
    the layout stays the job's, and the clipping and precision SMP used are named as the flags to pass."""
    params = {"ddp": True, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.5, "bf16": True}
    code, out, err = _native(tmp_path, params, capsys, "--world-size", "4", "--trainer")
    assert code == 0
    config = json.loads(out)
    assert {config[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                "gradient_clipping")} == {"auto"}
    assert config["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 2}
    assert config["bf16"]["enabled"] is True
    assert "pass --max_grad_norm 0.5" in err and "pass --bf16" in err
    code, out, err = _native(tmp_path, {"ddp": True, "microbatches": 2}, capsys, "--world-size", "2", "--trainer",
                             "--batch-size", "4")
    assert code == 0 and json.loads(out)["train_micro_batch_size_per_gpu"] == "auto"
    assert "batch: SMP's per-rank batch" not in err  # no counted batch beside the Trainer's "auto"


def test_trainer_mode_is_refused_where_no_deepspeed_json_is_written(tmp_path, capsys):
    source = tmp_path / "smp.json"
    source.write_text(json.dumps({"ddp": True}), encoding="utf-8")
    assert main(["convert", str(source), "--trainer"]) == 2
    assert ("--trainer shapes the DeepSpeed JSON of --to accelerate or --to deepspeed --native, not --to deepspeed "
            "without --native") in capsys.readouterr().err
