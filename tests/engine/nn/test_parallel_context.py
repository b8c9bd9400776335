"""smp.nn's building blocks are built in an explicit parallel context: they keep the group they were given and never
look the layout up in the global state (:mod:`smp2ds.engine.nn.parallel.context`)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from smp2ds.engine.nn.parallel import context
from smp2ds.engine.nn.parallel.context import ParallelContext
from smp2ds.engine.nn.parallel.group import SINGLE, TPGroup
from smp2ds.engine.nn.parallel.modules import DistributedEmbedding, DistributedLinear
from smp2ds.engine.nn.parallel.rng import RngManager
from tests.engine.runtime_fixtures import single_rank_runtime

ENGINE = Path(__file__).resolve().parents[3] / "engine"


@pytest.fixture
def clean_contexts():
    """No installed context and no `using` block during the test; the process's own restored after."""
    from smp2ds.engine.core.state import state

    saved = (context._contexts.installed, list(context._contexts.scoped), context._contexts.single, state.runtime)
    context._contexts.installed, context._contexts.scoped[:] = None, []
    try:
        yield
    finally:
        context._contexts.installed, context._contexts.scoped[:], context._contexts.single, state.runtime = saved


def two_ranks(rank: int, seed: int = 5) -> ParallelContext:
    """Rank ``rank`` of a two-rank tensor-parallel group (no process group: building needs no collective)."""
    return ParallelContext(tp=TPGroup(handle=None, rank=rank, size=2, ranks=(0, 1), rng=RngManager(seed)))


def test_the_active_context_is_the_innermost_using_then_the_installed_one_then_a_single_process(clean_contexts):
    assert context.resolve().tp.size == 1 and context.resolve().tp.handle is None
    installed, inner, innermost = two_ranks(0), two_ranks(1), ParallelContext(pipeline_stages=3)
    context.install(installed)
    assert context.resolve() is installed and context.installed() is installed
    with context.using(inner):
        assert context.resolve() is inner
        with context.using(innermost):
            assert context.resolve() is innermost
        assert context.resolve() is inner
        assert context.resolve(installed) is installed  # an explicit context wins
    assert context.resolve() is installed
    context.forget()
    assert context.resolve().tp.size == 1
    with pytest.raises(RuntimeError, match="smp.init"):
        context.installed()


def test_a_module_keeps_the_rank_and_stream_of_its_explicit_context(clean_contexts):
    """Ranks 0 and 1 of one group, built in one process, hold the two halves of the tensor their group's stream
    draws (nn.Linear's init, from that stream's first generator), whatever context is active."""
    with context.using(ParallelContext()):  # the active context: no tensor parallelism
        halves = [DistributedLinear(3, 6, parallel_context=two_ranks(rank)) for rank in (0, 1)]
    reference = torch.empty(6, 3)
    torch.nn.init.kaiming_uniform_(reference, a=math.sqrt(5), generator=RngManager(5).init_generator())
    assert [h.weight.shape for h in halves] == [torch.Size([3, 3])] * 2
    assert torch.equal(torch.cat([h.weight for h in halves]), reference)
    assert [h.tp.rank for h in halves] == [0, 1]


def test_a_registered_class_built_in_a_using_block_takes_that_group(clean_contexts):
    """The replacement pass builds a script's registered classes (SMP's signatures, no context argument) in a
    `using` block: the smp.nn modules they build take its group."""
    with context.using(two_ranks(1)):
        embedding = DistributedEmbedding(10, 4)
    plain = DistributedEmbedding(10, 4)
    assert embedding.tp.rank == 1 and embedding.weight.shape == (10, 2)
    assert plain.tp.size == 1 and plain.weight.shape == (10, 4)


def test_a_copied_module_computes_over_the_same_group_and_stream(clean_contexts):
    module = DistributedLinear(3, 6, parallel_context=two_ranks(0))
    twin = copy.deepcopy(module)
    assert twin.tp is module.tp and twin.tp.rng is module.tp.rng
    assert twin.weight is not module.weight and torch.equal(twin.weight, module.weight)  # the weights are copied


def test_reset_starts_the_streams_again_from_their_seeds(clean_contexts):
    context.install(two_ranks(0, seed=9))
    first = context.resolve().tp.rng.init_generator().initial_seed()
    context.resolve().tp.rng.init_generator()
    restarted = context.restart_streams()
    assert restarted.tp.rng.seed == 9 and restarted is context.installed()
    assert restarted.tp.rng.init_generator().initial_seed() == first == 9
    assert dataclasses.replace(restarted.tp, rng=SINGLE.rng) == restarted.tp  # same group, new stream


def test_smp_reset_restarts_the_stream_scripts_see_as_smp_state_rng_manager(clean_contexts):
    import smdistributed.modelparallel.torch as smp

    context.install(two_ranks(0, seed=4))
    smp.state.runtime = before = single_rank_runtime(context=context.installed())
    assert smp.state.rng_manager is before.context.tp.rng
    context.resolve().tp.rng.init_generator()
    smp.reset()
    assert smp.state.runtime is not before and smp.state.runtime.plan is before.plan  # the same run, a new stream
    assert smp.state.rng_manager is context.installed().tp.rng is smp.state.runtime.context.tp.rng
    assert smp.state.rng_manager.init_generator().initial_seed() == 4  # the first draw again


def test_a_region_runs_on_its_groups_stream_and_restores_the_callers():
    stream = RngManager(3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with stream.region_stream():
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(3)
    assert torch.equal(inside, torch.rand(4))  # the stream starts where torch.manual_seed(seed) would


# ---- no building block reads the layout from the global state -------------------------------------------------
BUILDING_BLOCKS = ("nn", "tensor_parallel", "pipeline", "data_parallel", "mics", "memory", "checkpoint_tools")
LAYOUT = {"groups", "plan", "initialized", "cfg", "config", "rng_manager", "topology", "launch", "mics_groups"}
"""``state`` attributes that describe the layout (what the parallel context, the Plan or the groups hand in)."""
CONSTRUCTORS = {"nn/parallel/modules.py", "nn/transformer_layers.py", "nn/transformer.py"}
"""The public smp.nn classes: SMP's signatures, so their constructors resolve the active context."""


def layout_lookups(root: Path, packages: tuple[str, ...] = BUILDING_BLOCKS) -> list[str]:
    """``file:line what`` of every read of the layout from the global state in ``packages`` of ``root``: a
    ``state.<layout>`` attribute, a call of ``installed()`` (the composition root's), or ``resolve()`` outside a
    public smp.nn constructor."""
    found: list[tuple[str, int, str]] = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = str(path.relative_to(root))
            tree = ast.parse(path.read_text())
            constructors = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__init__"
                            for n in ast.walk(f)} if name in CONSTRUCTORS else set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                        node.value.id == "state" and node.attr in LAYOUT:
                    found.append((name, node.lineno, f"state.{node.attr}"))
                if isinstance(node, ast.Call):
                    called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    if called == "installed" or (called == "resolve" and id(node) not in constructors
                                                 and name != "nn/parallel/context.py"):
                        found.append((name, node.lineno, f"{called}()"))
    return [f"{name}:{line} {what}" for name, line, what in sorted(found)]


def test_no_building_block_looks_the_layout_up():
    assert layout_lookups(ENGINE) == []


def test_the_check_finds_a_lookup(tmp_path):
    (tmp_path / "nn").mkdir()
    (tmp_path / "nn" / "m.py").write_text(
        "def f():\n    return state.groups.topology.tp\n\n\nclass A:\n    def __init__(self):\n"
        "        self.tp = resolve().tp\n\n    def forward(self):\n        return installed()\n")
    assert layout_lookups(tmp_path, ("nn",)) == ["nn/m.py:2 state.groups", "nn/m.py:7 resolve()",
                                                 "nn/m.py:10 installed()"]


# ---- a model whose smp.nn modules were built for another group is refused ----------------------------------------
def test_modules_built_for_another_group_are_named(clean_contexts):
    run = two_ranks(0)
    model = torch.nn.Sequential(DistributedLinear(3, 6, parallel_context=run),
                                torch.nn.Sequential(DistributedLinear(3, 6)),  # the single-process context
                                torch.nn.Linear(3, 3))
    assert context.built_for_another_group(model, run) == ["1.0"]
    assert context.built_for_another_group(model, ParallelContext()) == ["0"]
    other_ranks = ParallelContext(tp=TPGroup(handle=None, rank=0, size=2, ranks=(2, 3)))
    assert context.built_for_another_group(model, other_ranks) == ["0", "1.0"]


def _build_before_init() -> str:
    import smdistributed.modelparallel.torch as smp

    early = torch.nn.Sequential(smp.nn.DistributedLinear(4, 8), torch.nn.ReLU())  # before smp.init: one process
    smp.init({"tensor_parallel_degree": 2, "ddp": True})
    try:
        smp.DistributedModel(early)
    except smp.exceptions.SMPUnsupportedError as err:
        return str(err)
    return "accepted"


@pytest.mark.slow
def test_distributed_model_refuses_smp_nn_modules_built_before_smp_init():
    from tests._dist import run_ranks

    for message in run_ranks(_build_before_init, 2):
        assert "the model's smp.nn modules '0' were built for another tensor-parallel group" in message
        assert "tensor_parallel_degree 2" in message and "after smp.init()" in message
