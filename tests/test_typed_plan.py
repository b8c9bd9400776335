"""The engine reads a typed Plan: ``Plan.engine_settings`` (frozen dataclasses), never ``plan.engine[...]``.

* the planner's ``/engine`` JSON and :class:`EngineSettings` are one thing: parsing a Plan's
  ``engine`` mapping and serialising it again gives the same JSON text (key order included), for
  every example config and for planned layouts covering each backend;
* the dataclass defaults are SMP's: ``EngineSettings()`` is the plan of an empty configuration on
  one process;
* a mapping the settings do not describe is refused, naming the key;
* no module under ``engine/`` (nor ``smdistributed/``) reads the Plan's engine section by key any
  more: an ``ast`` scan for ``<x>.engine[...]``, ``engine[...]`` and ``<x>.engine.get(...)``.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from smp2ds.translator import load_document, normalize, plan
from smp2ds.translator.engine_settings import EngineSettings
from smp2ds.translator.pipeline_schedule import PipelineSection
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.sharded_data import MicsSettings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "configs").glob("*.json"))

# name -> (SMP parameters, world size, ranks per node, per-rank batch): one layout per backend and the
# settings that fill the other sections (SMP v2 input is below; smdistributed.dataparallel is an example).
LAYOUTS = {
    "data-parallel": ({"ddp": True, "microbatches": 2}, 4, 4, 8),
    "zero1-fp16-offload": ({"ddp": True, "shard_optimizer_state": True, "fp16": True, "offload_activations": True,
                            "activation_loading_horizon": 2, "ddp_port": 29511}, 2, 2, None),
    "pipeline-simple": ({"partitions": 2, "microbatches": 4, "pipeline": "simple", "ddp": True,
                         "auto_partition": False, "default_partition": 1, "placement_strategy": "spread"}, 8, 8, 16),
    "tensor-parallel-memory": ({"tensor_parallel_degree": 2, "ddp": True, "optimize": "memory", "bf16": True,
                                "tensor_parallel_seed": 7}, 4, 2, 4),
    "mics-across-nodes": ({"sharded_data_parallel_degree": 4, "ddp": True, "delayed_parameter_initialization": True},
                          16, 2, 8),
    "mics-too-large-to-list": ({"sharded_data_parallel_degree": 8, "ddp": True}, 128, 8, None),
    "tensor-parallel+mics": ({"tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "ddp": True,
                              "prescaled_batch": True}, 8, 4, 4),
}


def _planned(name: str):
    params, world, per_node, batch = LAYOUTS[name]
    layout = Layout(world_size=world, gpus_per_node=per_node, batch_size=batch)
    return plan(normalize(params, layout), layout)


def _plans():
    for path in EXAMPLES:
        yield path.name, plan(normalize(load_document(str(path))))
    for name in LAYOUTS:
        yield name, _planned(name)
    layout = Layout(world_size=8, gpus_per_node=8)
    v2 = {"torch_distributed": {"enabled": True}, "smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "random_seed": 11}}}}
    yield "smp-v2", plan(normalize(v2, layout), layout)

PLANS = dict(_plans())


def test_every_example_and_backend_is_covered():
    assert len(EXAMPLES) >= 6  # a moved folder must not empty the parametrisation
    backends = {p.engine_settings.backend.name for p in PLANS.values()}
    assert backends == {"pipeline", "tensor-parallel+mics", "tensor-parallel", "mics", "deepspeed-data-parallel"}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_engine_section_round_trips_through_the_dataclasses(name):
    engine = PLANS[name].engine
    settings = EngineSettings.from_engine(engine)
    assert settings.to_dict() == engine
    # Byte-identical JSON, key order included: what `smp2ds convert --to plan` prints is unchanged.
    assert json.dumps(settings.to_dict()) == json.dumps(dict(engine))
    assert EngineSettings.from_engine(json.loads(json.dumps(dict(engine)))) == settings  # from the JSON text too


def test_plan_engine_settings_is_parsed_once_and_typed():
    p = _planned("mics-across-nodes")
    settings = p.engine_settings
    assert settings is p.engine_settings
    assert isinstance(settings.mics, MicsSettings) and isinstance(settings.pipeline, PipelineSection)
    # 16 ranks, 2 per node, shard groups of 4 consecutive ranks: every group spans 2 nodes.
    assert settings.mics.shard_groups == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    assert settings.mics.nodes_per_shard_group == 2 and settings.mics.hierarchical_allgather is True
    assert settings.delayed_parameter_initialization is True and settings.data_parallel.rdp_degree == 16
    with pytest.raises(AttributeError):
        settings.mics.shard_size = 2  # type: ignore[misc]  # frozen


def test_sections_carry_the_configuration():
    pipe = _planned("pipeline-simple").engine_settings
    assert (pipe.pipeline.stages, pipe.pipeline.schedule, pipe.pipeline.partition.auto) == (2, "gpipe", False)
    assert pipe.pipeline.partition.default_partition == 1 and pipe.placement.strategy == "spread"
    tp = _planned("tensor-parallel-memory").engine_settings
    assert (tp.tensor_parallel.degree, tp.tensor_parallel.optimize, tp.tensor_parallel.seed) == (2, "memory", 7)
    assert tp.precision.dtype == "bf16" and tp.batch.tp_input_gather is True and tp.batch.source == "layout"
    zero1 = _planned("zero1-fp16-offload").engine_settings
    assert (zero1.zero_stage, zero1.precision.dtype, zero1.process_group.port) == (1, "fp16", 29511)
    assert (zero1.activation_checkpointing.offload, zero1.activation_checkpointing.loading_horizon) == (True, 2)
    assert zero1.batch.per_rank_batch is None
    assert PLANS["smp-v2"].engine_settings.tensor_parallel.seed == 11
    assert PLANS["hf_qa_data_parallel_003.json"].engine_settings.strategy == "dataparallel"


def test_defaults_are_the_plan_of_an_empty_config_on_one_process():
    layout = Layout(world_size=1, gpus_per_node=1)
    assert EngineSettings().to_dict() == plan(normalize({}, layout), layout).engine


def test_an_unknown_key_is_refused_with_its_pointer():
    engine = json.loads(json.dumps(dict(_planned("data-parallel").engine)))
    engine["mics"]["shard_sise"] = 2
    with pytest.raises(ValueError, match=r"/engine/mics has the keys \['shard_sise'\]"):
        EngineSettings.from_engine(engine)
    with pytest.raises(ValueError, match=r"/engine/pipeline/partition is 'auto'"):
        EngineSettings.from_engine({"pipeline": {"partition": "auto"}})


# ---- no engine module reads the Plan's engine section by key -------------------------------------------------


def _keyed_engine_reads(source: str) -> list[int]:
    """Lines of ``<x>.engine[...]``, ``engine[...]``, ``<x>.engine.get(...)`` and of any use of a
    Plan's mapping itself (``plan.engine``, ``<x>.plan.engine``) in ``source``, in order.

    DeepSpeed engine objects are used through attributes (``self.engine.module``), never subscripted,
    so they do not match."""

    def is_engine(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "engine") or (
            isinstance(node, ast.Name) and node.id == "engine"
        )

    def is_plan(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "plan") or (
            isinstance(node, ast.Name) and node.id == "plan"
        )

    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and is_engine(node.value):
            lines.add(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and is_engine(node.func.value)):
            lines.add(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "engine" and is_plan(node.value):
            lines.add(node.lineno)
    return sorted(lines)


def test_the_scan_finds_keyed_reads():
    old = (
        'name = state.plan.engine["backend"]["name"]\n'
        'settings = state.plan.engine.get("activation_checkpointing") or {}\n'
        "engine = plan.engine\n"
        'shard = int(engine["mics"]["shard_size"])\n'
        "module = self.engine.module\n"
        "settings = plan.engine_settings.mics\n"
        "seed = TensorParallelSettings.from_engine(state.plan.engine).seed\n"
        "loss = model.engine(batch)\n"
    )
    assert _keyed_engine_reads(old) == [1, 2, 3, 4, 7]


def test_no_engine_module_reads_the_plan_engine_by_key():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("engine", "smdistributed")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line in _keyed_engine_reads(path.read_text())
    ]
    assert found == [], "read Plan.engine_settings (typed) instead of plan.engine[...]: " + ", ".join(found)


def test_the_launcher_section_is_typed_and_read_typed_by_the_cli_and_tools():
    """``Plan.launcher_settings`` holds every field of ``/launcher``; the CLI and the tools read it (and the
    topology and engine sections) typed, never by key."""
    document = load_document(str(ROOT / "examples" / "configs" / "gpt2_30b_sdp_002.json"))
    p = plan(normalize(document, None), None)  # the estimator names its instances: 32 nodes of 8 GPUs
    settings = p.launcher_settings
    assert settings.nodes == p.launcher["nodes"] == 32 and settings.world_size == 256
    assert list(settings.command("torchrun")) == list(p.launcher["torchrun"]) and dict(settings.env) == p.launcher["env"]
    keyed = [f"{path.relative_to(ROOT)}:{node.lineno}"
             for folder in ("cli", "translator/tools") for path in sorted((ROOT / folder).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
             and node.value.attr in ("launcher", "topology")]
    assert keyed == [], "read launcher_settings / topology_settings: " + ", ".join(keyed)
