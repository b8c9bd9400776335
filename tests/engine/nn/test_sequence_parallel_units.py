"""``optimize: memory`` without processes: the Plan carries it to the engine's tensor-parallel group, its
fate says where it applies, and Hugging Face blocks sharded in place (which run the speed layout) warn
once."""

from __future__ import annotations

import warnings

import pytest

from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.tensor_parallel import families
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan
from tests.engine.workers import transformer_workers as tw


def _plan(params: dict):
    layout = Layout(world_size=2, gpus_per_node=2)
    return plan(normalize(params, layout), layout)


@pytest.mark.parametrize("optimize", ["memory", "speed"])
def test_the_plan_carries_optimize_and_its_fate_is_the_engine_with_tensor_parallelism(optimize):
    p = _plan({"ddp": True, "tensor_parallel_degree": 2, "optimize": optimize})
    assert p.engine["tensor_parallel"]["optimize"] == optimize
    note = {n.key: n for n in p.notes}["optimize"]
    assert note.fate == "engine" and note.target == "/engine/tensor_parallel/optimize"
    assert "sequence" in note.reason and "Hugging Face blocks sharded in place" in note.reason


def test_without_tensor_parallelism_optimize_is_ignored():
    note = {n.key: n for n in _plan({"ddp": True, "optimize": "memory"}).notes}["optimize"]
    assert note.fate == "ignored" and "tensor parallelism" in note.reason


@pytest.mark.parametrize("optimize", ["memory", "speed"])
def test_blocks_sharded_in_place_warn_once_that_they_run_the_speed_layout(optimize, monkeypatch):
    monkeypatch.setattr(families, "_WARNED", [])
    tp = TPGroup(handle=None, rank=0, size=2, ranks=(0, 1), optimize=optimize)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (0, 1):
            assert families.shard_model(tw.hf_gpt2(seed), tp) == ["transformer.h.0", "transformer.h.1"]
    ours = [str(w.message) for w in caught if "optimize: memory" in str(w.message)]
    if optimize == "speed":
        assert ours == []
        return
    assert len(ours) == 1
    assert "GPT2LMHeadModel's GPT2Block blocks, sharded in place under their Hugging Face names, run the speed " \
           "layout" in ours[0]
