"""The engine reads the translator's typed Plan, never an untyped one: no function of ``engine/`` takes a plan, a
state, a topology, a launch environment, settings, process groups or a parallel context as ``Any`` (mypy, run by ``.ci/typecheck``,
then checks every read of them), and no module reads the Plan's topology by string key."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"
TYPED = {"plan", "state", "topology", "launch", "settings", "groups", "context", "parallel_context"}
"""Parameter names that must carry their type (``Plan``, ``State``, ``Topology``, ``LaunchEnv``, the
``ParallelContext`` smp.nn's building blocks are built in, ...)."""


def untyped_parameters(root: Path = ENGINE) -> list[str]:
    """``file:line name`` of every parameter named in :data:`TYPED` annotated ``Any`` or not annotated."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            for arg in args:
                if arg.arg not in TYPED:
                    continue
                annotation = ast.unparse(arg.annotation) if arg.annotation is not None else None
                if annotation in (None, "Any", "typing.Any"):
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}({arg.arg}: {annotation})")
    return found


def test_no_engine_function_takes_a_plan_or_state_untyped():
    assert untyped_parameters() == []


def test_the_check_finds_an_untyped_plan(tmp_path):
    (tmp_path / "m.py").write_text("from typing import Any\n\n\ndef f(plan: Any, state, x: Any) -> None:\n    pass\n")
    assert untyped_parameters(tmp_path) == ["m.py:4 f(plan: Any)", "m.py:4 f(state: None)"]


def test_no_engine_module_reads_the_plans_topology_by_key():
    readers = [f"{path.relative_to(ENGINE)}:{node.lineno}"
               for path in sorted(ENGINE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
               and node.value.attr == "topology" and isinstance(node.slice, ast.Constant)]
    assert readers == [], "read plan.topology_settings (typed) instead"


SMP_SURFACE_READS = {
    ("api/checkpoint.py", "get_config_dict"): "the configuration a checkpoint records, as SMP's smp_config.pt did",
    ("api/hf_trainer_repairs.py", "prescaled_batch"): "the Trainer's own read, repaired where it reads it",
}
"""The only reads of ``state.cfg`` (the SMP keys as scripts see them) inside the engine: each is SMP's own surface.
Every other decision reads the typed Plan (``state.plan.engine_settings``, ``topology_settings``) or the groups."""


def test_the_engine_reads_raw_smp_keys_only_where_smp_scripts_do():
    reads = set()
    for path in sorted(ENGINE.rglob("*.py")):
        if path.relative_to(ENGINE).as_posix() == "core/state.py":
            continue  # where ConfigView is defined
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "cfg"
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "state"):
                reads.add((path.relative_to(ENGINE).as_posix(), node.attr))
    assert reads == set(SMP_SURFACE_READS)
