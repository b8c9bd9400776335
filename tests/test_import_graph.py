"""The import graph of ``smp2ds.cli``, ``smp2ds.translator`` and ``smp2ds.engine``, read from the files with ``ast``.

* no import cycle among those modules (imports inside functions count: a lazy import only
  hides a circle, it does not remove it);
* the translator stays pure: it never imports ``smp2ds.engine``, torch or deepspeed;
* the CLI is the top floor: neither the translator nor the engine imports it;
* no package imports ``smdistributed`` (that is the drop-in package built on the engine).

An edge goes to the module an import names: ``from pkg import name`` is an import of
``pkg.name`` when that is a module file, else of ``pkg``. Importing ``a.b.c`` also runs
``a/b/__init__.py``, but that is not counted as an edge: a package ``__init__`` importing its
own submodules, and a submodule importing a sibling by absolute name, is no cycle unless the
sibling imports back. ``importlib.import_module("...")`` / ``__import__("...")`` with a constant
name count as imports; names built at run time cannot be seen. Imports under
``if TYPE_CHECKING:`` never run: they are checked for forbidden modules but make no cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"smp2ds.cli": ROOT / "cli", "smp2ds.translator": ROOT / "translator", "smp2ds.engine": ROOT / "engine"}


@dataclass(frozen=True)
class Import:
    source: str  # dotted name of the importing module
    target: str  # dotted name of the module imported (resolved, absolute)
    line: int
    typing_only: bool  # under `if TYPE_CHECKING:`

    def where(self, files: dict[str, Path]) -> str:
        return f"{files[self.source].relative_to(ROOT)}:{self.line}"


def module_files(packages: dict[str, Path] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under cli/, translator/ and engine/."""
    files: dict[str, Path] = {}
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join([package, *parts])] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.AST, bool]]:
    """Every import statement or constant-name import call, anywhere (functions included), with
    whether it sits under ``if TYPE_CHECKING:``."""

    def visit(node: ast.AST, typing_only: bool) -> Iterator[tuple[ast.AST, bool]]:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, typing_only
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if (
                name in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                yield node, typing_only
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, True)
            for child in node.orelse:
                yield from visit(child, typing_only)
            return
        for child in ast.iter_child_nodes(node):
            yield from visit(child, typing_only)

    yield from visit(tree, False)


def _package_of(module: str, files: dict[str, Path]) -> str:
    """The package a module's relative imports start from (itself for an ``__init__``)."""
    return module if files[module].name == "__init__.py" else module.rpartition(".")[0]


def imports_of(module: str, files: dict[str, Path]) -> list[Import]:
    """The modules ``module`` imports, as absolute dotted names (ours resolved to module files)."""
    tree = ast.parse(files[module].read_text(encoding="utf-8"), filename=str(files[module]))
    found: list[Import] = []
    for node, typing_only in _import_nodes(tree):
        line = getattr(node, "lineno", 0)
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.Call):
            targets = [node.args[0].value]
        else:
            assert isinstance(node, ast.ImportFrom)
            if node.level:
                base = _package_of(module, files).split(".")
                up = node.level - 1
                if up >= len(base):
                    raise AssertionError(f"{files[module]}:{line}: relative import above the top package")
                base = base[: len(base) - up]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                candidate = f"{origin}.{alias.name}"
                targets.append(candidate if candidate in files else origin)
        found.extend(Import(module, target, line, typing_only) for target in targets)
    return found


def import_graph() -> tuple[dict[str, Path], dict[str, list[Import]]]:
    files = module_files()
    graph = {module: imports_of(module, files) for module in files}
    return files, graph


def find_cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan), each as
    a path ``[a, b, ..., a]``; sorted so failures read the same on every run."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(node: str) -> None:
        # Iterative, so a deep import chain cannot hit the recursion limit.
        work = [(node, iter(sorted(edges.get(node, ()))))]
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        while work:
            current, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[current] = min(low[current], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[current])
            if low[current] == index[current]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == current:
                        break
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            strongconnect(node)

    cycles = []
    for component in components:
        if len(component) < 2:
            continue
        members = set(component)
        start = min(component)
        # Shortest way back to `start` inside the component (breadth first).
        previous: dict[str, str] = {}
        frontier = [start]
        while start not in previous:
            step = []
            for node in frontier:
                for child in sorted(edges.get(node, ())):
                    if child in members and child not in previous:
                        previous[child] = node
                        step.append(child)
            frontier = step
        path = [start]
        node = previous[start]
        while node != start:
            path.append(node)
            node = previous[node]
        path.append(start)
        path.reverse()
        cycles.append(path)
    return sorted(cycles)


# ---------------------------------------------------------------------------------------------
# the resolver itself, on a small made-up tree


def test_resolver_on_a_made_up_package(tmp_path):
    pkg = tmp_path / "translator"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import thing\nfrom . import b\n")
    (pkg / "a.py").write_text("def f():\n    from smp2ds.translator.b import other\n")
    (pkg / "b.py").write_text("import json\nfrom smp2ds.translator import a\n")
    (pkg / "cli" / "__init__.py").write_text("from .. import c\nfrom ..a import thing\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .cli import x\n"
        "import importlib\nimportlib.import_module('torch')\n"
    )
    files = module_files({"smp2ds.translator": pkg})
    assert set(files) == {
        "smp2ds.translator",
        "smp2ds.translator.a",
        "smp2ds.translator.b",
        "smp2ds.translator.c",
        "smp2ds.translator.cli",
    }
    graph = {m: imports_of(m, files) for m in files}
    targets = {m: sorted(i.target for i in imps) for m, imps in graph.items()}
    assert targets["smp2ds.translator"] == ["smp2ds.translator.a", "smp2ds.translator.b"]
    assert targets["smp2ds.translator.a"] == ["smp2ds.translator.b"]  # inside a function
    assert targets["smp2ds.translator.b"] == ["json", "smp2ds.translator.a"]
    assert targets["smp2ds.translator.cli"] == ["smp2ds.translator.a", "smp2ds.translator.c"]
    assert targets["smp2ds.translator.c"] == ["importlib", "smp2ds.translator.cli", "torch", "typing"]
    assert [i.typing_only for i in graph["smp2ds.translator.c"] if i.target.endswith("cli")] == [True]
    edges = {m: [i.target for i in imps if not i.typing_only and i.target in files] for m, imps in graph.items()}
    # __init__ -> a, __init__ -> b is no cycle; a <-> b (one of them lazy) is.
    assert find_cycles(edges) == [["smp2ds.translator.a", "smp2ds.translator.b", "smp2ds.translator.a"]]


def test_find_cycles_reports_one_path_per_circle():
    edges = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d"], "f": ["a"]}
    assert find_cycles(edges) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert find_cycles({"pkg": ["pkg.x", "pkg.y"], "pkg.x": ["pkg.y"], "pkg.y": []}) == []


# ---------------------------------------------------------------------------------------------
# the real packages


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, Path], dict[str, list[Import]]]:
    return import_graph()


def _edge_lines(path: list[str], graph: dict[str, list[Import]], files: dict[str, Path]) -> str:
    lines = []
    for source, target in zip(path, path[1:]):
        at = ", ".join(dict.fromkeys(i.where(files) for i in graph[source] if not i.typing_only and i.target == target))
        lines.append(f"      {source} -> {target}  ({at})")
    return "\n".join(lines)


def _cycle_report(cycles: list[list[str]], graph: dict[str, list[Import]], files: dict[str, Path]) -> str:
    blocks = [" -> ".join(c) + "\n" + _edge_lines(c, graph, files) for c in cycles]
    return f"{len(cycles)} import cycle(s):\n" + "\n".join(f"  {b}" for b in blocks)


def test_every_module_was_found(graph):
    files, _ = graph
    assert "smp2ds.translator.normalize" in files and "smp2ds.engine" in files
    assert "smp2ds.cli.launch" in files


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycles(graph, package):
    files, imports = graph
    edges = {
        module: sorted({i.target for i in found if not i.typing_only and i.target in files})
        for module, found in imports.items()
    }
    cycles = [c for c in find_cycles(edges) if c[0] == package or c[0].startswith(package + ".")]
    if cycles:
        pytest.fail(_cycle_report(cycles, imports, files), pytrace=False)


def test_translator_never_imports_engine_torch_or_deepspeed(graph):
    files, imports = graph
    bad = [
        f"{i.where(files)}: {i.source} imports {i.target}"
        for module, found in imports.items()
        if module.startswith("smp2ds.translator")
        for i in found
        if (
            i.target.split(".")[0] in ("torch", "deepspeed")
            or i.target == "smp2ds.engine"
            or i.target.startswith("smp2ds.engine.")
        )
    ]
    if bad:
        pytest.fail("the translator must stay pure:\n  " + "\n  ".join(bad), pytrace=False)


def test_the_cli_is_the_top_floor(graph):
    """The CLI imports the translator and (inside the functions serving ``--model``, ``--memory``, ``checkpoint``)
    the engine; neither imports it back."""
    files, imports = graph
    bad = [f"{i.where(files)}: {i.source} imports {i.target}" for module, found in imports.items()
           if not module.startswith("smp2ds.cli") for i in found
           if i.target == "smp2ds.cli" or i.target.startswith("smp2ds.cli.")]
    if bad:
        pytest.fail("the CLI stands above the translator and the engine:\n  " + "\n  ".join(bad), pytrace=False)


def test_nothing_imports_smdistributed(graph):
    files, imports = graph
    bad = [
        f"{i.where(files)}: {i.source} imports {i.target}"
        for found in imports.values()
        for i in found
        if i.target.split(".")[0] == "smdistributed"
    ]
    if bad:
        pytest.fail("smdistributed is built on smp2ds, never the other way round:\n  " + "\n  ".join(bad), pytrace=False)


def test_imports_of_our_modules_resolve(graph):
    # An import of smp2ds.translator/engine that names no module file is a typo or a stale path.
    files, imports = graph
    bad = [
        f"{i.where(files)}: {i.target}"
        for found in imports.values()
        for i in found
        if i.target.startswith(("smp2ds.cli", "smp2ds.translator", "smp2ds.engine")) and i.target not in files
    ]
    if bad:
        pytest.fail("imports of modules that do not exist:\n  " + "\n  ".join(bad), pytrace=False)


# ---------------------------------------------------------------------------------------------
# layering: imports only go down

# The engine's packages (first name under smp2ds.engine; a top-level module counts as its own package)
# and the ones each may import. `core` is the runtime every parallelism builds on; the parallelism
# packages (data_parallel, mics, tensor_parallel, pipeline) import core and nn, never each other;
# the top (engine/__init__.py) may import anything.
LAYERS: dict[str, set[str]] = {
    "exceptions": set(),
    # the ground floor: the runtime the public API stands on (state, groups, comm, launch environment,
    # checkpoint files, the DeepSpeed config adapter, the protocols); no parallelism package, no API module
    "core": {"exceptions"},
    "diagnostics": {"exceptions", "core"},
    "integrations": {"exceptions", "core"},
    "nn": {"exceptions", "core", "integrations"},
    "data_parallel": {"exceptions", "core", "nn"},
    "mics": {"exceptions", "core", "nn"},
    "tensor_parallel": {"exceptions", "core", "nn", "integrations"},
    "pipeline": {"exceptions", "core", "nn", "integrations"},
    # `smp2ds checkpoint` (offline): reads checkpoints with the families' shard rules and shard specs and
    # exports with smp.nn's Hugging Face translators, all in nn
    "checkpoint_tools": {"exceptions", "core", "nn"},
    # the memory estimate (`smp2ds explain --memory`, offline): traces a model cut the way the parallelism
    # packages cut it (tensor_parallel's sharding, pipeline's layer list); nothing imports it but the CLI
    "memory": {"exceptions", "core", "nn", "tensor_parallel", "pipeline"},
    # the public smp.* objects (init, DistributedModel, DistributedOptimizer, step, checkpoints, model creation,
    # smp.amp, smp.optimizers, the scripts' helpers) and the composition root (backend_factory) that builds the
    # backend the Plan names from the packages below
    "api": {"exceptions", "core", "diagnostics", "integrations", "nn", "data_parallel", "mics", "tensor_parallel",
            "pipeline"},
}
TOP = {"smp2ds.engine"}
"""Above every package: ``engine/__init__.py``, the public ``smp.*`` surface gathered from ``api``."""

# Package edges allowed against the rule: none. A new one fails the test; an entry added here that no
# longer occurs fails too, so the list can only shrink.
KNOWN_CROSSINGS: set[tuple[str, str]] = set()


def engine_package(module: str) -> str | None:
    """The layer of one of the engine's modules (None for the top and for anything outside the engine)."""
    if module in TOP or not module.startswith("smp2ds.engine."):
        return None
    return module.split(".")[2]


def crossings(imports: dict[str, list[Import]]) -> dict[tuple[str, str], list[Import]]:
    """Every import between two engine packages that ``LAYERS`` does not allow, by package pair."""
    found: dict[tuple[str, str], list[Import]] = {}
    for source, listed in imports.items():
        below = engine_package(source)
        if below is None:
            continue
        for i in listed:
            target = engine_package(i.target)
            if target is None or target == below or target in LAYERS[below] or i.typing_only:
                continue
            found.setdefault((below, target), []).append(i)
    return found


def test_layering_catches_an_upward_import():
    made_up = {
        "smp2ds.engine.core.state": [Import("smp2ds.engine.core.state", "smp2ds.engine.pipeline.manual", 3, False),
                                     Import("smp2ds.engine.core.state", "smp2ds.engine.core.comm", 4, False)],
        "smp2ds.engine.api.backend_factory": [
            Import("smp2ds.engine.api.backend_factory", "smp2ds.engine.pipeline.backend", 9, False)],
        "smp2ds.engine.mics.sharding": [
            Import("smp2ds.engine.mics.sharding", "smp2ds.engine.core.backend", 5, True),
            Import("smp2ds.engine.mics.sharding", "smp2ds.engine.tensor_parallel.mpu", 6, True)],
    }
    assert list(crossings(made_up)) == [("core", "pipeline")]


def test_every_engine_package_has_a_layer(graph):
    files, _ = graph
    packages = {engine_package(m) for m in files} - {None}
    assert packages == set(LAYERS), "give a new package its place in LAYERS"


def test_imports_only_go_down(graph):
    files, imports = graph
    found = crossings(imports)
    new = {pair: listed for pair, listed in found.items() if pair not in KNOWN_CROSSINGS}
    lines = [f"{i.where(files)}: {i.source} imports {i.target}" for listed in new.values() for i in listed]
    if lines:
        pytest.fail("imports against the layering (LAYERS in this file):\n  " + "\n  ".join(lines), pytrace=False)
    gone = KNOWN_CROSSINGS - set(found)
    assert not gone, f"remove these fixed crossings from KNOWN_CROSSINGS: {sorted(gone)}"


def uncommented_local_imports(files: dict[str, Path], root: Path = ROOT) -> list[str]:
    """``file:line`` of every import of our own modules (absolute, ``from smp2ds import x`` or relative) inside a
    function without a comment on its line, its last line or the line above (the comment says what needs it there:
    start-up time or an optional part)."""
    found = []
    for path in files.values():
        text = path.read_text()
        lines = text.splitlines()
        for function in ast.walk(ast.parse(text)):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                relative = isinstance(node, ast.ImportFrom) and node.level > 0  # a sibling module: ours too
                if not relative and not any(name == "smp2ds" or name.startswith("smp2ds.") for name in names):
                    continue
                near = [lines[node.lineno - 1], lines[(node.end_lineno or node.lineno) - 1], lines[node.lineno - 2]]
                if "#" not in near[0] and "#" not in near[1] and not near[2].strip().startswith("#"):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(set(found))


def test_imports_inside_functions_say_why(graph):
    """In the engine and in the CLI (whose subcommand modules import the pure translator at their top: only the
    chosen subcommand's module is loaded, so a function-local import there needs a reason too)."""
    files, _ = graph
    checked = {name: path for name, path in files.items() if name.startswith(("smp2ds.engine", "smp2ds.cli"))}
    assert uncommented_local_imports(checked) == [], (
        "import at the top of the module, or say in a comment why it must wait (start-up time, optional part)")


def test_uncommented_local_imports_are_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from smp2ds.engine import core\n\n\ndef g():\n"
                      "    from smp2ds.engine import mics  # start-up: imports DeepSpeed\n\n\ndef h():\n"
                      "    from . import report\n    from smp2ds import schemas\n    import json\n")
    assert uncommented_local_imports({"m": module}, root=tmp_path) == ["m.py:10", "m.py:11", "m.py:2"]


# ---- docs/architecture.md says what these tests check ----------------------------------------------------------
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _markdown_rows(text: str, header: str) -> list[list[str]]:
    """The body rows (cells) of the table whose header row starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _code_spans(cell: str) -> list[str]:
    return cell.split("`")[1::2]


def documented_layers(text: str) -> dict[str, set[str]]:
    """The architecture page's layer table: engine package -> the engine packages it says the package may import."""
    layers: dict[str, set[str]] = {}
    for package_cell, allowed_cell in _markdown_rows(text, "| Package | May import |"):
        packages = [span.removeprefix("engine/").removesuffix("/").removesuffix(".py")
                    for span in _code_spans(package_cell) if span.startswith("engine/")]
        allowed = {span for span in _code_spans(allowed_cell) if span in LAYERS}
        for package in packages:
            if package in LAYERS:
                layers[package] = allowed
    return layers


def test_the_architecture_pages_layer_table_is_the_enforced_one():
    assert documented_layers(ARCHITECTURE.read_text()) == LAYERS


def torch_distributed_importers(root: Path = ROOT) -> set[str]:
    """The engine's modules that import ``torch.distributed`` (or a module under it)."""
    found = set()
    for path in (root / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in names):
                found.add(path.relative_to(root).as_posix())
    return found


def test_the_modules_that_import_torch_distributed_are_the_documented_ones():
    documented = {cells[0].strip("`") for cells in _markdown_rows(ARCHITECTURE.read_text(), "| Module | Why |")}
    assert torch_distributed_importers() == documented


def test_the_modules_that_read_smp_state_are_the_documented_ones(graph):
    """Only SMP's handle-free API (and what reports on the running job) reads ``smp.state``; everything below takes
    the runtime as an argument. The table in docs/architecture.md is the list."""
    files, imports = graph
    readers = {files[module].relative_to(ROOT).as_posix() for module, found in imports.items()
               if module != "smp2ds.engine.core.state"
               for i in found if i.target == "smp2ds.engine.core.state" and not i.typing_only}
    documented = {span for cells in _markdown_rows(ARCHITECTURE.read_text(), "| Module that imports the state |")
                  for span in _code_spans(cells[0])}
    assert readers == documented


def test_process_groups_are_created_in_one_module():
    """``comm.new_group`` (the only caller of torch's) is called from ``core/process_groups.py`` alone."""
    callers = set()
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "new_group":
                callers.add(path.relative_to(ROOT).as_posix())
    assert callers == {"engine/core/comm.py", "engine/core/process_groups.py"}


def test_the_pure_configuration_path_imports_no_tool_and_no_cli(graph):
    """``translator/`` (load, validate, normalize, plan and their parts) stands alone: the tools
    (``translator/tools/``) build on it, and the CLI (``cli/``) on both, never the other way."""
    _, imports = graph
    upward = [f"{source} imports {i.target}" for source, listed in imports.items()
              if source.startswith("smp2ds.translator") and not source.startswith("smp2ds.translator.tools")
              for i in listed if i.target.startswith("smp2ds.translator.tools")]
    assert upward == []
