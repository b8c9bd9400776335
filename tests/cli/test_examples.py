"""Every seed scenario in examples/configs validates, converts and explains through the CLI.

The expected layouts are the seeds' own numbers (instances x processes per host, degrees), not
values read back from the translator: a wrong world size or degree in the plan fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from smp2ds.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "configs"
PLAN_KEYS = {"topology", "deepspeed", "engine", "megatron", "launcher", "notes"}

# name -> (world size, pipeline degree, tensor degree, reduced-data-parallel degree), from the seeds.
SEED_LAYOUTS: dict[str, tuple[int, int, int, int]] = {
    "bert_pipeline_000.json": (1 * 8, 2, 1, 4),  # 1 x ml.p3.16xlarge, partitions 2, ddp
    "docs_example_001.json": (1 * 8, 2, 1, 4),  # 1 x ml.p3.16xlarge, partitions 2, ddp
    "gpt2_30b_sdp_002.json": (32 * 8, 1, 1, 256),  # 32 x ml.p4d.24xlarge, sharded DP 128
    "hf_glue_model_parallel_003.json": (1 * 8, 4, 1, 2),  # 8 processes, partitions 4
    "hf_qa_data_parallel_003.json": (2 * 8, 1, 1, 16),  # 2 x ml.p3.16xlarge, smdistributed.dataparallel
    "gpt3_175b_tp_pp_004.json": (120 * 8, 8, 8, 15),  # 120 x ml.p4d.24xlarge, tp 8, pp 8
}


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def given_parameter_keys(doc: dict) -> set[str]:
    smd = doc["distribution"]["smdistributed"]
    return set(smd.get("modelparallel", {}).get("parameters", {}))


def test_examples_folder_holds_exactly_the_seed_scenarios():
    assert sorted(p.name for p in EXAMPLES.glob("*.json")) == sorted(SEED_LAYOUTS)


@pytest.mark.parametrize("name", sorted(SEED_LAYOUTS))
def test_example_validates(name, capsys):
    code, out, _ = run(["validate", str(EXAMPLES / name)], capsys)
    assert code == 0, out


@pytest.mark.parametrize("name", sorted(SEED_LAYOUTS))
def test_example_converts_to_plan_with_seed_layout(name, capsys):
    code, out, err = run(["convert", str(EXAMPLES / name), "--to", "plan", "--format", "json"], capsys)
    assert code == 0, err
    plan = json.loads(out)
    assert set(plan) == PLAN_KEYS
    world, pp, tp, rdp = SEED_LAYOUTS[name]
    topo = plan["topology"]
    assert topo["world_size"] == world
    assert topo["pipeline_parallel_degree"] == pp
    assert topo["tensor_parallel_degree"] == tp
    assert topo["rdp_degree"] == rdp
    assert plan["deepspeed"]["gradient_clipping"] is not None


def test_sharded_example_has_seed_shard_and_replicas(capsys):
    code, out, _ = run(
        ["convert", str(EXAMPLES / "gpt2_30b_sdp_002.json"), "--to", "plan", "--format", "json"], capsys
    )
    assert code == 0
    topo = json.loads(out)["topology"]
    assert topo["sharded_data_parallel_degree"] == 128
    assert topo["replicas"] == 2  # 256 GPUs / 128 = 2, as the seed says


@pytest.mark.parametrize("name", sorted(SEED_LAYOUTS))
def test_example_deepspeed_config_is_json(name, capsys):
    code, out, _ = run(["convert", str(EXAMPLES / name)], capsys)
    assert code == 0
    assert isinstance(json.loads(out), dict)


@pytest.mark.parametrize("name", sorted(SEED_LAYOUTS))
def test_example_explains_every_given_key(name, capsys):
    code, out, err = run(["explain", str(EXAMPLES / name), "--params", "1.3B", "--format", "json"], capsys)
    assert code == 0, err
    report = json.loads(out)
    explained = {note["key"] for note in report["keys"]}
    given = given_parameter_keys(json.loads((EXAMPLES / name).read_text()))
    assert given <= explained, f"keys without a fate: {sorted(given - explained)}"
    assert all(note["fate"] in ("mapped", "engine", "ignored", "unsupported") for note in report["keys"])
    code, text, _ = run(["explain", str(EXAMPLES / name)], capsys)
    assert code == 0
    for key in given:
        assert key in text
