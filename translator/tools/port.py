"""``smp2ds port SCRIPT.py``: an SMP v1 script rewritten into a plain PyTorch + DeepSpeed script.

A codemod on libcst's concrete syntax tree: comments, formatting and the script's own names are kept; nothing is
rewritten with regular expressions. What has an exact equivalent is rewritten; what needs a person keeps its
line, gets a ``# smp2ds port:`` comment and an entry in the report; nothing is dropped silently.

Rewrites (``smp`` is whatever name the script imported ``smdistributed.modelparallel.torch`` as):

* the import -> ``import deepspeed`` and ``import torch.distributed as dist``, plus a short block of helpers and
  the path of the DeepSpeed config written beside the ported script (the job's layout, ``convert --native``);
* ``smp.init(...)`` -> ``deepspeed.init_distributed()``;
* ``smp.rank() / size() / local_rank() / barrier()`` -> ``torch.distributed``'s; ``dp_rank / dp_size / rdp_rank /
  rdp_size`` likewise when the layout has no tensor or pipeline parallelism (else marked);
* ``M = smp.DistributedModel(X)`` -> ``M = X``; then ``O = smp.DistributedOptimizer(Y)`` ->
  ``M, O, _, _ = deepspeed.initialize(model=M, optimizer=Y, config=...)`` (``M`` is DeepSpeed's engine from
  there on: ``M(x)``, ``M.backward(loss)`` are its own);
* ``@smp.step`` is removed and each call of the step function runs it once per micro-batch (SMP's ``microbatches``,
  the arguments split along their first dimension) with ``engine.step()`` after each, as DeepSpeed's gradient
  accumulation wants; the result keeps ``reduce_mean()``, ``concat()`` and ``outputs``;
* ``O.step()`` and ``O.zero_grad(...)`` -> nothing (the engine stepped and zeroed at the accumulation boundary);
* ``M.state_dict()`` -> ``M.module.state_dict()``; ``smp.save_checkpoint(path, tag=..., model=M, ...,
  user_content=C)`` -> ``M.save_checkpoint(path, tag=..., client_state=C)``;
* ``smp.allgather(obj, group)`` -> every rank's ``obj`` (``dist.all_gather_object`` over the world, the
  data-parallel group when there is no model parallelism);
* ``smp.state`` -> ``None`` (SMP's and smp2ds's run state: DeepSpeed has none), marked.

Everything else under ``smp.`` is marked for a person: pipelines (DeepSpeed's ``PipelineModule`` needs a layer
list), ``smp.nn`` modules, ``smp.resume_from_checkpoint`` (``engine.load_checkpoint`` once the engine exists), ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider

MARK = "# smp2ds port: "
SMP_MODULE = "smdistributed.modelparallel.torch"


@dataclass
class Change:
    """One rewrite or one place left for a person: its line, what was there, what is there now or why."""

    line: int
    before: str
    after: str
    manual: bool = False


@dataclass
class PortResult:
    code: str
    changes: list[Change] = field(default_factory=list)
    ported: bool = False
    """False when the script has no SMP import (nothing to port)."""

    @property
    def manual(self) -> list[Change]:
        return [c for c in self.changes if c.manual]


_SIMPLE = {"init": "deepspeed.init_distributed()", "rank": "dist.get_rank()", "size": "dist.get_world_size()",
           "local_rank": 'int(os.environ.get("LOCAL_RANK", 0))', "barrier": "dist.barrier()"}
_DATA_PARALLEL = {"dp_rank": "dist.get_rank()", "rdp_rank": "dist.get_rank()", "dp_size": "dist.get_world_size()",
                  "rdp_size": "dist.get_world_size()"}
_WHY = {
    "resume_from_checkpoint": "resume with engine.load_checkpoint(path, tag) after deepspeed.initialize (it returns "
                              "(path, client_state)); SMP checkpoints: `smp2ds checkpoint export --to "
                              "deepspeed-universal` first",
    "partition": "pipelines: DeepSpeed's PipelineModule needs the model as a layer list (docs/leaving-smp.md)",
    "set_partition": "pipelines: DeepSpeed's PipelineModule needs the model as a layer list (docs/leaving-smp.md)",
    "nn": "smp.nn modules have no DeepSpeed equivalent: use the Hugging Face model (export its weights) or AutoTP",
    "model_creation": "tensor parallelism: DeepSpeed AutoTP (tensor_parallel.autotp_size in the config) on a "
                      "family it supports; the distributed transformer has none",
    "state": "SMP's run state has no DeepSpeed equivalent (replaced by None)",
}


def _helpers(config_name: str, microbatches: int) -> str:
    return f'''
# smp2ds port: what SMP did for this script, in plain PyTorch + DeepSpeed
_DS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), {config_name!r})
_MICROBATCHES = {microbatches}


class _StepOutput(list):
    """SMP's StepOutput: one result per micro-batch."""

    @property
    def outputs(self):
        return list(self)

    def reduce_mean(self):
        return torch.stack([torch.as_tensor(o) for o in self]).mean()

    def reduce_sum(self):
        return torch.stack([torch.as_tensor(o) for o in self]).sum()

    def concat(self):
        return torch.cat(list(self))


def _smp_step(fn, engine, *args, **kwargs):
    """SMP's @smp.step: fn once per micro-batch (tensor arguments split along dim 0), the engine stepping after each
    (DeepSpeed updates at the gradient-accumulation boundary)."""
    parts = [a.chunk(_MICROBATCHES) if torch.is_tensor(a) else [a] * _MICROBATCHES for a in args]
    out = _StepOutput()
    for i in range(_MICROBATCHES):
        out.append(fn(engine, *[p[i] for p in parts], **kwargs))
        engine.step()
    return out


def _smp_allgather(obj):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
'''


class _Porter(m.MatcherDecoratableTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, module: cst.Module, model_parallel: bool) -> None:
        super().__init__()
        self.module = module
        self.model_parallel = model_parallel
        self.alias: str | None = None
        self.changes: list[Change] = []
        self.step_functions: set[str] = set()
        self.model_name: str | None = None
        self.optimizer_name: str | None = None
        self._pending_marks: list[str] = []
        self._headers: list[list[str]] = []
        self._block_marks: list[str] = []

    # ---- helpers ---------------------------------------------------------------------------------------
    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def _code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node).strip()

    def _is_smp(self, node: cst.BaseExpression, attr: str | None = None) -> bool:
        if not isinstance(node, cst.Attribute) or not isinstance(node.value, cst.Name):
            return False
        return node.value.value == self.alias and (attr is None or node.attr.value == attr)

    def _record(self, node: cst.CSTNode, after: str, manual: bool = False) -> None:
        self.changes.append(Change(self._line(node), self._code(node), after, manual))

    # ---- imports ----------------------------------------------------------------------------------------
    def visit_Module(self, node: cst.Module) -> None:
        for statement in node.body:
            if m.matches(statement, m.SimpleStatementLine(body=[m.Import()])):
                for alias in statement.body[0].names:  # type: ignore[attr-defined]
                    if node.code_for_node(alias.name) == SMP_MODULE:
                        self.alias = alias.asname.name.value if alias.asname else SMP_MODULE

    # ---- statements ------------------------------------------------------------------------------------
    def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine,
                                  updated: cst.SimpleStatementLine) -> Any:
        if self.alias is None or len(updated.body) != 1:
            return self._marked(updated)
        stmt = updated.body[0]
        if isinstance(stmt, cst.Import) and any(self.module.code_for_node(a.name) == SMP_MODULE for a in stmt.names):
            self._record(original, "import os; import deepspeed; import torch; import torch.distributed as dist")
            return cst.FlattenSentinel([cst.parse_statement(line) for line in (
                "import os\n", "import deepspeed\n", "import torch\n", "import torch.distributed as dist\n")])
        if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, cst.Call):
            call, target = stmt.value, stmt.targets[0].target
            if self._is_smp(call.func, "DistributedModel") and isinstance(target, cst.Name) and call.args:
                self.model_name = target.value
                self._record(original, f"{target.value} = <the model>")
                return updated.with_changes(body=[stmt.with_changes(value=call.args[0].value)])
            if self._is_smp(call.func, "DistributedOptimizer") and isinstance(target, cst.Name) and call.args:
                if self.model_name is None:
                    return self._mark_line(original, updated, "DistributedOptimizer before DistributedModel: "
                                           "build the model first, then deepspeed.initialize(model, optimizer)")
                self.optimizer_name = target.value
                inner = self.module.code_for_node(call.args[0].value)
                text = (f"{self.model_name}, {target.value}, _, _ = deepspeed.initialize(model={self.model_name}, "
                        f"optimizer={inner}, config=_DS_CONFIG)")
                self._record(original, text)
                # the script's own argument node is kept (with any comment around it); keywords added around it
                first = call.args[0].with_changes(keyword=cst.Name("optimizer"), equal=cst.AssignEqual(
                    whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
                if first.comma == cst.MaybeSentinel.DEFAULT:
                    first = first.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
                new_call = call.with_changes(
                    func=cst.parse_expression("deepspeed.initialize"),
                    args=[cst.Arg(cst.Name(self.model_name), keyword=cst.Name("model"), equal=first.equal,
                                  comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                          first, cst.Arg(cst.Name("_DS_CONFIG"), keyword=cst.Name("config"), equal=first.equal)])
                targets = [cst.AssignTarget(cst.parse_expression(f"{self.model_name}, {target.value}, _, _"))]
                return updated.with_changes(body=[stmt.with_changes(targets=targets, value=new_call)])
        if isinstance(stmt, cst.Expr) and isinstance(stmt.value, cst.Call):
            func = stmt.value.func
            if (self.optimizer_name and isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)
                    and func.value.value == self.optimizer_name and func.attr.value in ("step", "zero_grad")):
                self._record(original, "(removed: the engine steps and zeroes at each accumulation boundary)")
                return cst.RemoveFromParent()
            if self._is_smp(func, "save_checkpoint"):
                return self._save_checkpoint(original, updated, stmt.value)
        return self._marked(updated)

    def _save_checkpoint(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine,
                         call: cst.Call) -> Any:
        kwargs = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        positional = [a.value for a in call.args if a.keyword is None]
        model = kwargs.get("model")
        if model is None or not positional:
            return self._mark_line(original, updated,
                                   "save_checkpoint without model=: save with engine.save_checkpoint")
        parts = [self.module.code_for_node(positional[0])]
        tag = kwargs.get("tag", positional[1] if len(positional) > 1 else None)
        if tag is not None:
            parts.append(f"tag={self.module.code_for_node(tag)}")
        if "user_content" in kwargs:
            parts.append(f"client_state={self.module.code_for_node(kwargs['user_content'])}")
        text = f"{self.module.code_for_node(model)}.save_checkpoint({', '.join(parts)})"
        self._record(original, text)
        return updated.with_changes(body=[cst.parse_statement(text).body[0]])  # type: ignore[attr-defined]

    def _mark_line(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine, why: str) -> Any:
        self._record(original, why, manual=True)
        return _with_mark(updated, why)

    def _marked(self, updated: cst.SimpleStatementLine) -> Any:
        """A line holding expressions marked for a person (collected while its expressions were left)."""
        if not self._pending_marks:
            return updated
        why, self._pending_marks = "; ".join(dict.fromkeys(self._pending_marks)), []
        return _with_mark(updated, why)

    # ---- compound statements: a mark goes after the header's colon ------------------------------------------
    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._headers.append(self._pending_marks)  # what the header (with ...:, if ...:) left for a person
        self._pending_marks = []

    def leave_IndentedBlock(self, original: cst.IndentedBlock, updated: cst.IndentedBlock) -> Any:
        header = self._headers.pop()
        if header:
            self._block_marks = header
        return updated

    def _mark_header(self, updated: Any) -> Any:
        marks, self._block_marks = self._block_marks, []
        if not marks or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        why = "; ".join(dict.fromkeys(marks))
        own = updated.body.header.comment
        text = f"{own.value}  {MARK}{why}" if own is not None else MARK + why
        header = cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(text))
        return updated.with_changes(body=updated.body.with_changes(header=header))

    def leave_With(self, original: cst.With, updated: cst.With) -> Any:
        return self._mark_header(updated)

    def leave_If(self, original: cst.If, updated: cst.If) -> Any:
        return self._mark_header(updated)

    def leave_For(self, original: cst.For, updated: cst.For) -> Any:
        return self._mark_header(updated)

    def leave_While(self, original: cst.While, updated: cst.While) -> Any:
        return self._mark_header(updated)

    # ---- decorators and calls -----------------------------------------------------------------------
    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> Any:
        kept = []
        for deco in updated.decorators:
            if self.alias and self._is_smp(deco.decorator, "step"):
                self.step_functions.add(original.name.value)
                self.changes.append(Change(self._line(original), f"@{self.alias}.step def {original.name.value}",
                                           f"def {original.name.value}: each call runs it once per micro-batch"))
            else:
                kept.append(deco)
        return updated.with_changes(decorators=kept)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> Any:
        func = updated.func
        if isinstance(func, cst.Name) and func.value in self.step_functions:
            self._record(original, f"_smp_step({func.value}, ...)")
            return updated.with_changes(func=cst.Name("_smp_step"), args=[cst.Arg(func), *updated.args])
        if (self.model_name and isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)
                and func.value.value == self.model_name and func.attr.value == "state_dict" and not updated.args):
            self._record(original, f"{self.model_name}.module.state_dict()")
            return cst.parse_expression(f"{self.model_name}.module.state_dict()")
        if self.alias is None or not isinstance(func, cst.Attribute) or not self._is_smp(func):
            return updated
        name = func.attr.value
        if name in _SIMPLE:
            self._record(original, _SIMPLE[name])
            return cst.parse_expression(_SIMPLE[name])
        if name in _DATA_PARALLEL and not self.model_parallel:
            self._record(original, _DATA_PARALLEL[name])
            return cst.parse_expression(_DATA_PARALLEL[name])
        if name == "allgather" and not self.model_parallel and updated.args:
            text = f"_smp_allgather({self.module.code_for_node(updated.args[0].value)})"
            self._record(original, text)
            return cst.parse_expression(text)
        if name not in ("DistributedModel", "DistributedOptimizer", "save_checkpoint", "step"):
            self._leave_for_person(original, name)
        return updated

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> Any:
        if self.alias is None:
            return updated
        if self._is_smp(original, "state"):
            self._record(original, "None", manual=True)
            self._pending_marks.append(_WHY["state"])
            return cst.Name("None")
        base = original
        while isinstance(base.value, cst.Attribute):
            base = base.value
        if self._is_smp(base, "state"):  # smp.state.cfg...: the whole chain is SMP's run state
            return cst.Name("None")
        return updated

    def _leave_for_person(self, node: cst.CSTNode, name: str) -> None:
        why = _WHY.get(name, f"{self.alias}.{name} has no rewrite here: port it by hand (docs/leaving-smp.md)")
        self._record(node, why, manual=True)
        self._pending_marks.append(why)


def _with_mark(line: cst.SimpleStatementLine, why: str) -> cst.SimpleStatementLine:
    """``line`` with the port's comment, after the script's own comment when it has one."""
    own = line.trailing_whitespace.comment
    text = f"{own.value}  {MARK}{why}" if own is not None else MARK + why
    return line.with_changes(trailing_whitespace=cst.TrailingWhitespace(
        whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(text)))


def port_source(source: str, *, config_name: str, microbatches: int, model_parallel: bool) -> PortResult:
    """``source`` ported (see the module docstring); raises ``cst.ParserSyntaxError`` on a file that does not
    parse."""
    module = cst.parse_module(source)
    wrapper = cst.MetadataWrapper(module)
    porter = _Porter(wrapper.module, model_parallel)
    porter.visit_Module(wrapper.module)
    if porter.alias is None:
        return PortResult(source)
    ported = wrapper.visit(porter)
    helpers = cst.parse_module("pass\n" + _helpers(config_name, microbatches)).body[1:]  # keeps its comment
    body = list(ported.body)
    at = _after_imports(body)
    ported = ported.with_changes(body=[*body[:at], *helpers, *body[at:]])
    return PortResult(ported.code, porter.changes, ported=True)


def _after_imports(body: list[Any]) -> int:
    """Where the helpers go: after the module docstring and the leading imports."""
    at = 0
    for i, statement in enumerate(body):
        if m.matches(statement, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom() | m.Expr(m.SimpleString())])):
            at = i + 1
        else:
            break
    return at


def report(result: PortResult, script: str, notes: list[str]) -> str:
    """The Markdown report: every rewrite (line, before, after), every place left for a person, the semantics that
    differ at this layout."""
    lines = [f"# smp2ds port of {script}", ""]
    done = [c for c in result.changes if not c.manual]
    lines += [f"## Rewritten ({len(done)})", "", "| line | before | after |", "| --- | --- | --- |"]
    lines += [f"| {c.line} | `{_cell(c.before)}` | `{_cell(c.after)}` |" for c in done]
    lines += ["", f"## Left for a person ({len(result.manual)})", ""]
    lines += [f"- line {c.line}: `{_cell(c.before)}`: {c.after}" for c in result.manual] or ["nothing"]
    lines += ["", "## What differs from SMP at this layout", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("`", "'")
