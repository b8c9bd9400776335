"""``smp2ds port SCRIPT.py``: an SMP v1 script rewritten into a plain PyTorch + DeepSpeed script.

A codemod on libcst's concrete syntax tree: comments, formatting and the script's own names are kept; nothing is
rewritten with regular expressions. What has an exact equivalent is rewritten; what needs a person keeps its
line, gets a ``# smp2ds port:`` comment and an entry in the report; nothing is dropped silently.

Rewrites (``smp`` is whatever name the script imported ``smdistributed.modelparallel.torch`` as):

* the import -> ``import deepspeed`` and ``import torch.distributed as dist``, plus a short block of helpers and
  the path of the DeepSpeed config written beside the ported script (the job's layout, ``convert --native``);
* ``smp.init(...)`` -> ``deepspeed.init_distributed()``;
* ``smp.rank() / size() / local_rank() / barrier()`` -> ``torch.distributed``'s; ``dp_rank / dp_size / rdp_rank /
  rdp_size`` likewise when the layout has no tensor or pipeline parallelism; with tensor parallelism (no pipeline)
  ``rdp_rank / rdp_size / tp_rank / tp_size`` -> DeepSpeed's AutoTP layout (its (data, tensor) mesh: the
  tensor-parallel groups are consecutive ranks) while ``dp_rank / dp_size`` are marked (SMP's tensor-parallel ranks
  read their own rows, AutoTP's need the same rows); with a pipeline all of them are marked;
* ``with smp.model_creation(...):`` -> its body, when nothing in it needs SMP: at tensor_parallel_degree 1, or with
  ``tensor_parallelism=True`` for a Hugging Face family DeepSpeed's AutoTP shards (the config's
  ``tensor_parallel.autotp_size`` does it in ``deepspeed.initialize``); a family AutoTP refuses (GPT-2, ...), a
  family the class built there does not tell (``AutoModel...``), ``dtype``, ``zero_init`` or the distributed
  transformer's settings are marked;
* ``M = smp.DistributedModel(X)`` -> ``M = X`` (a line ``M = M`` goes); then ``O = smp.DistributedOptimizer(Y)`` ->
  ``M, O, _, _ = deepspeed.initialize(model=M, optimizer=Y, config=...)`` (``M`` is DeepSpeed's engine from
  there on: ``M(x)``, ``M.backward(loss)`` are its own);
* ``@smp.step`` is removed and each call of the step function runs it once per micro-batch (SMP's ``microbatches``,
  the arguments split along their first dimension) with ``engine.step()`` after each, as DeepSpeed's gradient
  accumulation wants; the result keeps ``reduce_mean()``, ``concat()`` and ``outputs``;
* ``O.step()`` and ``O.zero_grad(...)`` -> nothing (the engine stepped and zeroed at the accumulation boundary);
* ``M.state_dict()`` -> ``_smp_state_dict(M)``: as SMP's, the whole model under its own names on every rank (ZeRO-3
  partitions and AutoTP shards gathered first); ``smp.save_checkpoint(path, tag=..., model=M, ...,
  user_content=C)`` -> ``M.save_checkpoint(path, tag=..., client_state={"user_content": C})``;
* ``smp.resume_from_checkpoint(path, tag=..., partial=..., strict=..., load_optimizer=...)`` after the engine exists
  -> ``_smp_resume(M, path, ...)``: ``M.load_checkpoint`` of what the ported script saved (tag None: DeepSpeed's
  ``latest``), the optimizer and scheduler too unless ``load_optimizer`` is False or the checkpoint is a full one
  (SMP's ``partial=False`` holds weights only), returning the saved ``user_content``; before the engine exists, or
  with ``translate_function`` / ``load_sharded_optimizer_state``, it is marked;
* ``smp.allgather(obj, group)`` -> the ``obj`` of every rank of SMP's group (``dist.all_gather_object`` over the
  world, kept to the group's ranks): ``WORLD`` / ``DP_GROUP`` / ``RDP_GROUP`` / ``TP_GROUP`` / ``MP_GROUP`` without
  a pipeline;
* ``smp.broadcast(obj, group)`` / ``smp.recv_from(src, rank_type)`` -> ``_smp_broadcast(obj)`` /
  ``_smp_recv_from(src)`` (``dist.broadcast_object_list``) when the group is every rank (``WORLD``, and without
  tensor parallelism ``DP_GROUP`` / ``RDP_GROUP``) and the script sends nothing point to point (``smp.send``: then
  ``recv_from`` could match either, and all three are marked);
* ``M.load_state_dict(sd[, strict])`` -> ``_smp_load_state_dict(M, ...)``: the whole model on every rank loaded into
  ZeRO-3's partitions and AutoTP's shards, the optimizer's fp32 copies refreshed;
* ``smp.get_world_process_group() / get_dp_process_group()`` (and ``get_rdp_process_group()`` without tensor
  parallelism) -> ``dist.group.WORLD``; with tensor parallelism, after ``deepspeed.initialize``,
  ``get_rdp_process_group() / get_tp_process_group() / get_mp_process_group()`` -> DeepSpeed's AutoTP groups
  (``deepspeed.utils.groups``); the rest (a pipeline's, a tensor-parallel group of one) is marked;
* ``smp.state`` -> ``None`` (SMP's and smp2ds's run state: DeepSpeed has none), marked.

Everything else under ``smp.`` is marked for a person: pipelines (DeepSpeed's ``PipelineModule`` needs a layer
list), ``smp.nn`` modules, ``smp.amp``, ``smp.save`` / ``smp.load`` (per-rank file names), ...; a line that still
names the SMP module after the rewrites is marked, so nothing of SMP's is left unmarked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import libcst as cst
import libcst.matchers as m
from libcst.metadata import PositionProvider

from smp2ds.translator.tools.native_deepspeed import AUTOTP_REFUSED

MARK = "# smp2ds port: "
SMP_MODULE = "smdistributed.modelparallel.torch"
DOCS_LINK = "docs/leaving-smp.md#porting-the-script-smp2ds-port"
"""Where each item left for a person is explained: the report links it."""


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
    families: list[str] = field(default_factory=list)
    """The model families built for tensor parallelism (``smp.model_creation(tensor_parallelism=True)``), as
    DeepSpeed's AutoTP names them (lower case: ``llama``, ``gpt2``); empty when not told."""
    checkpoints: bool = False
    """True when a save or a resume was rewritten: the ported script then reads and writes DeepSpeed's layout."""

    @property
    def manual(self) -> list[Change]:
        return [c for c in self.changes if c.manual]


_SIMPLE = {"init": "deepspeed.init_distributed()", "rank": "dist.get_rank()", "size": "dist.get_world_size()",
           "local_rank": 'int(os.environ.get("LOCAL_RANK", 0))', "barrier": "dist.barrier()"}
_DATA_PARALLEL = {"dp_rank": "dist.get_rank()", "rdp_rank": "dist.get_rank()", "dp_size": "dist.get_world_size()",
                  "rdp_size": "dist.get_world_size()"}
# DeepSpeed's AutoTP builds a (data, tensor) mesh: tensor-parallel groups of consecutive ranks (the parentheses keep
# the expression whole wherever the call stood)
_AUTOTP_MESH = {"rdp_rank": "(dist.get_rank() // _TENSOR_PARALLEL)",
                "rdp_size": "(dist.get_world_size() // _TENSOR_PARALLEL)",
                "tp_rank": "(dist.get_rank() % _TENSOR_PARALLEL)", "tp_size": "_TENSOR_PARALLEL"}
_EVERY_RANK_GROUPS = {name: "dist.group.WORLD" for name in ("get_world_process_group", "get_dp_process_group")}
"""SMP's process groups that are every rank without a pipeline (its data-parallel group counts the tensor-parallel
ranks)."""
_AUTOTP_GROUPS = {"get_rdp_process_group": "deepspeed.utils.groups.get_data_parallel_group()",
                  "get_tp_process_group": "deepspeed.utils.groups.get_tensor_model_parallel_group()",
                  "get_mp_process_group": "deepspeed.utils.groups.get_tensor_model_parallel_group()"}
"""SMP's process groups with tensor parallelism and no pipeline -> the groups of DeepSpeed's AutoTP mesh (built in
``deepspeed.initialize``)."""
_GROUPS = {"WORLD": None, "DP_GROUP": None, "RDP_GROUP": "rdp", "TP_GROUP": "tp", "MP_GROUP": "tp"}
"""SMP's groups without a pipeline -> ``_smp_allgather``'s (None: the world)."""
_HF_CLASS = re.compile(r"([A-Z][A-Za-z0-9]*?)(?:With[A-Z]|LMHead|DoubleHeads|For[A-Z]|Model$)")
"""A Hugging Face model class and its family as AutoTP reads it (``GPT2LMHeadModel`` -> ``GPT2``)."""
_ROUTE = ("export the weights (`smp2ds checkpoint export CHECKPOINT --to hf DIR`) and train that model with data "
          "or sharded data parallelism (tensor_parallel_degree 1: drop tensor_parallel from the DeepSpeed config), "
          "or under accelerate (`smp2ds convert --to accelerate`) if it has a tp_plan")
_WHY = {
    "resume_from_checkpoint": "resume after deepspeed.initialize: _smp_resume(engine, path, tag=...) (DeepSpeed's "
                              "load_checkpoint, returning the saved user_content); a checkpoint SMP wrote: "
                              "`smp2ds checkpoint export --to deepspeed-universal` first",
    "partition": "pipelines: DeepSpeed's PipelineModule needs the model as a layer list (docs/leaving-smp.md)",
    "set_partition": "pipelines: DeepSpeed's PipelineModule needs the model as a layer list (docs/leaving-smp.md)",
    "nn": "smp.nn modules have no DeepSpeed equivalent: use the Hugging Face model (export its weights) or AutoTP",
    "model_creation": "tensor parallelism: DeepSpeed AutoTP (tensor_parallel.autotp_size in the config) on a "
                      "family it supports; the distributed transformer has none",
    "state_dict": "SMP's state_dict arguments have no DeepSpeed equivalent: _smp_state_dict(engine) is the whole "
                  "model on every rank",
    "state": "SMP's run state has no DeepSpeed equivalent (replaced by None)",
    "amp": "smp.amp.GradScaler: DeepSpeed scales fp16 losses itself (fp16 in the config): drop the scaler and its "
           "scale / step / update calls",
    "load_state_dict": "SMP's load_state_dict arguments have no DeepSpeed equivalent: _smp_load_state_dict(engine, "
                       "state_dict, strict) loads the whole model on every rank",
}
_RESUME_ARGUMENTS = ("path", "tag", "partial", "strict", "load_optimizer")
"""SMP's resume_from_checkpoint parameters in order (1.11+), as ``_smp_resume`` takes them."""
_RESUME_UNPORTED = {
    "translate_function": "resume_from_checkpoint translate_function: translate the state dict by hand (DeepSpeed "
                          "loads its own checkpoint under the engine's names)",
    "load_sharded_optimizer_state": "resume_from_checkpoint load_sharded_optimizer_state: DeepSpeed loads ZeRO's "
                                    "optimizer partitions whole or not at all (load_optimizer)",
}
_CREATION_ARGUMENTS = {
    "dtype": "model_creation dtype: torch.set_default_dtype around the construction (the old one restored after)",
    "zero_init": "model_creation zero_init: deepspeed.zero.Init(config_dict_or_path=_DS_CONFIG) around the "
                 "construction (ZeRO-3 builds the parameters partitioned)",
}
_WHY_TENSOR_PARALLEL = {
    "dp_rank": "with tensor parallelism SMP's dp_rank counts the tensor-parallel ranks, which read their own rows; "
               "AutoTP needs the same rows on a tensor-parallel group: index the data by rdp_rank",
    "dp_size": "with tensor parallelism SMP's dp_size counts the tensor-parallel ranks, which read their own rows; "
               "AutoTP needs the same rows on a tensor-parallel group: size the data by rdp_size",
}


def _helpers(config_name: str, microbatches: int, tensor_parallel: int) -> str:
    return f'''
# smp2ds port: what SMP did for this script, in plain PyTorch + DeepSpeed
_DS_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), {config_name!r})
_MICROBATCHES = {microbatches}
_TENSOR_PARALLEL = {tensor_parallel}  # AutoTP's degree: its tensor-parallel groups are consecutive ranks


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


def _smp_allgather(obj, group=None):
    """SMP's allgather: the obj of every rank of SMP's group (None: the world; "rdp": the ranks holding this
    rank's tensor-parallel shard; "tp": this rank's tensor-parallel group)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    me = dist.get_rank()
    if group == "rdp":
        return [o for r, o in enumerate(gathered) if r % _TENSOR_PARALLEL == me % _TENSOR_PARALLEL]
    if group == "tp":
        return [o for r, o in enumerate(gathered) if r // _TENSOR_PARALLEL == me // _TENSOR_PARALLEL]
    return gathered


def _smp_broadcast(obj):
    """SMP's broadcast to every rank: obj from this rank to the others, which call _smp_recv_from (a collective)."""
    dist.broadcast_object_list([obj], src=dist.get_rank())
    return obj


def _smp_recv_from(src):
    """SMP's recv_from matching a broadcast: the obj rank src sent."""
    box = [None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _smp_resume(engine, path, tag=None, partial=True, strict=True, load_optimizer=True):
    """SMP's resume_from_checkpoint on what this script saved with engine.save_checkpoint (tag None: the latest):
    the weights, and the optimizer and LR scheduler unless load_optimizer is False or the checkpoint is a full one
    (SMP's partial=False holds the weights only); returns the user_content saved with it (None when none was)."""
    restore = partial and load_optimizer
    found, client_state = engine.load_checkpoint(path, tag, load_module_strict=strict, load_optimizer_states=restore,
                                                 load_lr_scheduler_states=restore, load_module_only=not partial)
    if found is None:
        raise FileNotFoundError(f"no DeepSpeed checkpoint {{tag or '(latest)'}} under {{path}}")
    return (client_state or {{}}).get("user_content")


@contextlib.contextmanager
def _smp_whole(engine, modifier_rank=None):
    """The engine's module, whole on every rank inside (ZeRO-3's partitions and AutoTP's shards gathered; a
    collective: every rank calls it, as with SMP); with modifier_rank, what that rank wrote into it becomes every
    rank's part again when it ends (AutoTP cuts its shards again in any case)."""
    module = engine.module
    with contextlib.ExitStack() as gathered:
        if engine.zero_optimization_partition_weights():
            gathered.enter_context(deepspeed.zero.GatheredParameters(list(module.parameters()),
                                                                     modifier_rank=modifier_rank))
        if engine.autotp_size() > 1:
            from deepspeed.module_inject.layers import GatherReplacedLayerParams  # AutoTP's own gather and cut

            for sub in module.modules():
                gathered.enter_context(GatherReplacedLayerParams(list(sub.parameters(recurse=False)), sub))
        yield module


def _smp_load_state_dict(engine, state_dict, strict=True):
    """SMP's model.load_state_dict(): the whole model under its own names, the same on every rank, loaded into the
    engine's module (ZeRO-3's partitions and AutoTP's shards take their part when the gather ends); the optimizer's
    fp32 copies of the weights (ZeRO, fp16) are refreshed from them, as SMP's are."""
    with _smp_whole(engine, modifier_rank=0) as module:
        result = module.load_state_dict(state_dict, strict=strict)
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()
    return result


def _smp_state_dict(engine):
    """SMP's model.state_dict(): the whole model under its own names on every rank, copied to the CPU."""
    with _smp_whole(engine) as module:
        return {{k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}}
'''


class _Porter(m.MatcherDecoratableTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, module: cst.Module, tensor_parallel: int, pipeline_parallel: int) -> None:
        super().__init__()
        self.module = module
        self.tensor_parallel = tensor_parallel
        self.pipeline_parallel = pipeline_parallel
        self.families: list[str] = []
        self.checkpoints = False
        self.sends = False
        # the call of each `with smp.model_creation(...):` -> (None: the with becomes its body, or why not; the
        # family built in it)
        self._creations: dict[cst.Call, tuple[str | None, str | None]] = {}
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
                for alias in statement.body[0].names:  # type: ignore[attr-defined,index]
                    if node.code_for_node(alias.name) == SMP_MODULE:
                        self.alias = alias.asname.name.value if alias.asname else SMP_MODULE
        if self.alias is not None:  # recv_from matches a send or a broadcast: told apart by the script's calls
            self.sends = bool(m.findall(node, m.Call(func=m.Attribute(value=m.Name(self.alias), attr=m.Name("send")))))

    # ---- statements ------------------------------------------------------------------------------------
    def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine,
                                  updated: cst.SimpleStatementLine) -> Any:
        result = self._leave_line(original, updated)
        if self._pending_marks and isinstance(result, cst.SimpleStatementLine):
            # a rewritten line whose arguments hold something left for a person
            # (smp.DistributedModel(smp.nn.DistributedTransformer(...)))
            why, self._pending_marks = "; ".join(dict.fromkeys(self._pending_marks)), []
            return _with_mark(result, why)
        return result

    def _leave_line(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine) -> Any:
        if self.alias is None or len(updated.body) != 1:
            return self._marked(original, updated)
        stmt = updated.body[0]
        if isinstance(stmt, cst.Import) and any(self.module.code_for_node(a.name) == SMP_MODULE for a in stmt.names):
            self._record(original, "import contextlib; import os; import deepspeed; import torch; "
                                   "import torch.distributed as dist")
            return cst.FlattenSentinel([cst.parse_statement(line) for line in (
                "import contextlib\n", "import os\n", "import deepspeed\n", "import torch\n",
                "import torch.distributed as dist\n")])
        if isinstance(stmt, cst.Assign) and len(stmt.targets) == 1 and isinstance(stmt.value, cst.Call):
            call, target = stmt.value, stmt.targets[0].target
            if self._is_smp(call.func, "DistributedModel") and isinstance(target, cst.Name) and call.args:
                self.model_name = target.value
                model = call.args[0].value
                if isinstance(model, cst.Name) and model.value == target.value:  # M = smp.DistributedModel(M)
                    self._record(original, "(removed: the model is used as it is)")
                    return cst.RemoveFromParent()
                self._record(original, f"{target.value} = <the model>")
                return updated.with_changes(body=[stmt.with_changes(value=model)])
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
                unpacked = cst.ensure_type(cst.parse_expression(f"{self.model_name}, {target.value}, _, _"), cst.Tuple)
                targets = [cst.AssignTarget(unpacked)]
                return updated.with_changes(body=[stmt.with_changes(targets=targets, value=new_call)])
        if isinstance(stmt, cst.Expr) and isinstance(stmt.value, cst.Call):
            func = stmt.value.func
            if (self.optimizer_name and isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)
                    and func.value.value == self.optimizer_name and func.attr.value in ("step", "zero_grad")):
                self._record(original, "(removed: the engine steps and zeroes at each accumulation boundary)")
                return cst.RemoveFromParent()
            if self._is_smp(func, "save_checkpoint"):
                return self._save_checkpoint(original, updated, stmt.value)
        return self._marked(original, updated)

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
            parts.append(f'client_state={{"user_content": {self.module.code_for_node(kwargs["user_content"])}}}')
        text = f"{self.module.code_for_node(model)}.save_checkpoint({', '.join(parts)})"
        self.checkpoints = True
        self._record(original, text)
        return updated.with_changes(body=[cst.parse_statement(text).body[0]])  # type: ignore[attr-defined,index]

    def _mark_line(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine, why: str) -> Any:
        self._record(original, why, manual=True)
        return _with_mark(updated, why)

    def _marked(self, original: cst.SimpleStatementLine, updated: cst.SimpleStatementLine) -> Any:
        """A line holding expressions marked for a person (collected while its expressions were left); a line that
        still names the SMP module otherwise (``cls = smp.nn.DistributedTransformerLMHead``) is marked too: nothing
        of SMP's is left unmarked."""
        if not self._pending_marks and self.alias and m.findall(updated, m.Name(self.alias)):
            names = sorted({f"{self.alias}.{n.attr.value}" for n in m.findall(updated, m.Attribute(  # type: ignore
                value=m.Name(self.alias)))}) or [self.alias]
            why = f"{', '.join(names)}: no rewrite here: port it by hand (docs/leaving-smp.md)"
            self._record(original, why, manual=True)
            self._pending_marks.append(why)
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

    def visit_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> None:
        self._headers.append(self._pending_marks)  # as for an indented block: the header's marks
        self._pending_marks = []

    def leave_SimpleStatementSuite(self, original: cst.SimpleStatementSuite,
                                   updated: cst.SimpleStatementSuite) -> Any:
        """``with ...: statement`` on one line: the header's marks and the statement's share the line."""
        marks, self._pending_marks = self._headers.pop() + self._pending_marks, []
        if not marks:
            return updated
        why = "; ".join(dict.fromkeys(marks))
        return updated.with_changes(trailing_whitespace=_marked(updated.trailing_whitespace, why))

    def _mark_header(self, updated: Any) -> Any:
        marks, self._block_marks = self._block_marks, []
        if not marks or not isinstance(updated.body, cst.IndentedBlock):
            return updated
        why = "; ".join(dict.fromkeys(marks))
        return updated.with_changes(body=updated.body.with_changes(header=_marked(updated.body.header, why)))

    def leave_If(self, original: cst.If, updated: cst.If) -> Any:
        return self._mark_header(updated)

    def leave_For(self, original: cst.For, updated: cst.For) -> Any:
        return self._mark_header(updated)

    def leave_While(self, original: cst.While, updated: cst.While) -> Any:
        return self._mark_header(updated)

    # ---- smp.model_creation ---------------------------------------------------------------------------
    def visit_With(self, node: cst.With) -> None:
        call = _creation_call(node, self.alias)
        if call is not None:
            family = _family(node.body) if self.tensor_parallel > 1 else None
            self._creations[call] = (self._creation_verdict(call, family), family)

    def leave_With(self, original: cst.With, updated: cst.With) -> Any:
        call = _creation_call(original, self.alias)
        if call is not None and self._creations[call][0] is None:
            return self._unwrap(original, updated, self._creations[call][1])
        return self._mark_header(updated)

    def _creation_verdict(self, call: cst.Call, family: str | None) -> str | None:
        """None when ``with smp.model_creation(...):`` can become its body, else why not (the mark)."""
        kwargs = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        if len(kwargs) != len(call.args):
            return "model_creation with positional arguments: name them (tensor_parallelism=, dtype=, ...)"
        whys = [_CREATION_ARGUMENTS[k] for k in kwargs if k in _CREATION_ARGUMENTS]
        settings = [k for k in kwargs if k not in _CREATION_ARGUMENTS and k != "tensor_parallelism"]
        if settings:
            whys.append(f"model_creation {', '.join(settings)}: SMP's distributed transformer settings have no "
                        "DeepSpeed equivalent")
        if whys:
            return "; ".join(whys)
        if self.tensor_parallel <= 1:
            return None  # SMP shards nothing at tensor_parallel_degree 1
        marked = kwargs.get("tensor_parallelism")
        if not (isinstance(marked, cst.Name) and marked.value == "True"):
            return (f"at tensor_parallel_degree {self.tensor_parallel} SMP keeps what is built without "
                    "tensor_parallelism=True whole, while AutoTP shards the model deepspeed.initialize gets: if "
                    "this is that model, decide whether it may be sharded")
        if family is None:
            return ("tensor parallelism: the class built here does not tell the model family: drop this with if "
                    "DeepSpeed's AutoTP shards it (tensor_parallel.autotp_size in the config; AutoTP refuses "
                    f"{', '.join(AUTOTP_REFUSED)})")
        self.families.append(family)
        if family in AUTOTP_REFUSED:
            return f"tensor parallelism: DeepSpeed's AutoTP refuses the {family} family: {_ROUTE}"
        return None

    def _unwrap(self, original: cst.With, updated: cst.With, family: str | None) -> Any:
        """The with statement's body in its place; the with line's comments go before the first statement."""
        kept = list(updated.leading_lines)
        body = updated.body
        statements: list[cst.SimpleStatementLine | cst.BaseCompoundStatement]
        if isinstance(body, cst.IndentedBlock):
            if body.header.comment is not None:
                kept.append(cst.EmptyLine(comment=body.header.comment))
            statements = list(body.body)  # type: ignore[arg-type]  # an indented block holds statements
        else:  # with ...: statement (one line)
            suite = cst.ensure_type(body, cst.SimpleStatementSuite)
            statements = [cst.SimpleStatementLine(body=suite.body, trailing_whitespace=suite.trailing_whitespace)]
        statements[0] = statements[0].with_changes(leading_lines=[*kept, *statements[0].leading_lines])
        how = f"; AutoTP shards the {family} model in deepspeed.initialize" if family else ""
        self.changes.append(Change(self._line(original), self._code(original.items[0].item),
                                   f"(removed: the model is built as it is{how})"))
        return cst.FlattenSentinel(statements)

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
                and func.value.value == self.model_name and func.attr.value == "state_dict"):
            if updated.args:
                self._leave_for_person(original, "state_dict")
                return updated
            self._record(original, f"_smp_state_dict({self.model_name})")
            return cst.parse_expression(f"_smp_state_dict({self.model_name})")
        if (self.optimizer_name and isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)
                and func.value.value == self.model_name and func.attr.value == "load_state_dict"):
            return self._load_state_dict(original, updated)
        if self.alias is None or not isinstance(func, cst.Attribute):
            return updated
        if not self._is_smp(func):
            root = func
            while isinstance(root.value, cst.Attribute):
                root = root.value
            if self._is_smp(root) and root.attr.value != "state":  # smp.nn.X(...), smp.amp.GradScaler(...)
                self._leave_for_person(original, root.attr.value)
            return updated
        name = func.attr.value
        text = self._rewrite(name, updated)
        if text is not None:
            self._record(original, text)
            return cst.parse_expression(text)
        if name == "model_creation" and original in self._creations:
            why = self._creations[original][0]
            if why is not None:
                self._leave_for_person(original, name, why)
        elif name == "resume_from_checkpoint":
            unported = [_RESUME_UNPORTED[a.keyword.value] for a in updated.args
                        if a.keyword is not None and a.keyword.value in _RESUME_UNPORTED]
            engine = self.optimizer_name is not None
            self._leave_for_person(original, name, "; ".join(unported) if engine and unported else None)
        elif name in ("dp_rank", "dp_size") and self.tensor_parallel > 1 and self.pipeline_parallel <= 1:
            self._leave_for_person(original, name, _WHY_TENSOR_PARALLEL[name])
        elif name not in ("DistributedModel", "DistributedOptimizer", "save_checkpoint", "step"):
            self._leave_for_person(original, name)
        return updated

    def _rewrite(self, name: str, call: cst.Call) -> str | None:
        """The text replacing ``smp.<name>(...)`` at this layout, or None."""
        if name in _SIMPLE:
            return _SIMPLE[name]
        if self.pipeline_parallel > 1:
            return None
        if self.tensor_parallel <= 1 and name in _DATA_PARALLEL:
            return _DATA_PARALLEL[name]
        if self.tensor_parallel > 1 and name in _AUTOTP_MESH:
            return _AUTOTP_MESH[name]
        if name in _EVERY_RANK_GROUPS or (self.tensor_parallel <= 1 and name == "get_rdp_process_group"):
            return "dist.group.WORLD"
        if self.tensor_parallel > 1 and name in _AUTOTP_GROUPS and self.optimizer_name is not None:
            return _AUTOTP_GROUPS[name]  # once deepspeed.initialize has built them
        if name == "resume_from_checkpoint":
            return self._resume(call)
        if name in ("broadcast", "recv_from") and len(call.args) == 2 and not self.sends:
            whole = self._whole_world(call.args[1].value, name == "recv_from")
            first = self.module.code_for_node(call.args[0].value)
            return f"_smp_{name}({first})" if whole else None
        if name == "allgather" and call.args:
            group = self._group(call.args[1].value) if len(call.args) > 1 else ""
            if group is None:
                return None
            obj = self.module.code_for_node(call.args[0].value)
            return f'_smp_allgather({obj}, "{group}")' if group else f"_smp_allgather({obj})"
        return None

    def _load_state_dict(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """``M.load_state_dict(sd[, strict])`` on the engine -> ``_smp_load_state_dict(M, sd[, strict])``; SMP's own
        arguments (``same_partition_load``, ...) are marked."""
        names = [a.keyword.value if a.keyword is not None else None for a in updated.args]
        if not updated.args or any(a.star for a in updated.args) or not set(names) <= {None, "state_dict", "strict"}:
            self._leave_for_person(original, "load_state_dict")
            return updated
        args = [cst.Arg(cst.Name(self.model_name or "")), *[a.with_changes(comma=cst.MaybeSentinel.DEFAULT)
                                                             for a in updated.args]]
        args = [a.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))) for a in args[:-1]] + \
            [args[-1]]
        new = updated.with_changes(func=cst.Name("_smp_load_state_dict"), args=args)
        self._record(original, self.module.code_for_node(new))
        return new

    def _resume(self, call: cst.Call) -> str | None:
        """``_smp_resume(engine, ...)`` for ``smp.resume_from_checkpoint(...)`` once the engine exists; None (the
        call is marked) before it or with an argument DeepSpeed has no equivalent for."""
        if self.optimizer_name is None or self.model_name is None:
            return None
        given: dict[str, str] = {}
        for i, arg in enumerate(call.args):
            if arg.star:
                return None
            key = arg.keyword.value if arg.keyword is not None else (
                _RESUME_ARGUMENTS[i] if i < len(_RESUME_ARGUMENTS) else None)
            key = "load_optimizer" if key == "load_optimizer_states" else key  # SMP 1.10's name
            if key in _RESUME_UNPORTED or key not in _RESUME_ARGUMENTS:
                return None
            given[key] = self.module.code_for_node(arg.value)
        if "path" not in given:
            return None
        rest = [f"{k}={given[k]}" for k in _RESUME_ARGUMENTS[1:] if k in given]
        self.checkpoints = True
        return f"_smp_resume({', '.join([self.model_name, given['path'], *rest])})"

    def _whole_world(self, node: cst.BaseExpression, rank_type: bool) -> bool:
        """True when ``node`` names an SMP group (``rank_type``: a rank type) that is every rank at this layout."""
        if not isinstance(node, cst.Attribute):
            return False
        base = node.value
        if isinstance(base, cst.Attribute) and base.attr.value == ("RankType" if rank_type else "CommGroup"):
            base = base.value
        if not (isinstance(base, cst.Name) and base.value == self.alias):
            return False
        everyone = {"WORLD_RANK"} if rank_type else {"WORLD"}
        if self.tensor_parallel <= 1:  # without a pipeline (checked before): data parallelism is every rank
            everyone |= {"DP_RANK", "RDP_RANK"} if rank_type else {"DP_GROUP", "RDP_GROUP"}
        return node.attr.value in everyone

    def _group(self, node: cst.BaseExpression) -> str | None:
        """``smp.RDP_GROUP`` / ``smp.CommGroup.RDP_GROUP`` -> ``_smp_allgather``'s group ("" for the world), None
        for what is not one of SMP's groups."""
        if not isinstance(node, cst.Attribute) or node.attr.value not in _GROUPS:
            return None
        base = node.value
        if isinstance(base, cst.Attribute) and base.attr.value == "CommGroup":
            base = base.value
        if not (isinstance(base, cst.Name) and base.value == self.alias):
            return None
        return _GROUPS[node.attr.value] or ""

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

    def _leave_for_person(self, node: cst.CSTNode, name: str, why: str | None = None) -> None:
        why = why or _WHY.get(name, f"{self.alias}.{name} has no rewrite here: port it by hand (docs/leaving-smp.md)")
        self._record(node, why, manual=True)
        self._pending_marks.append(why)


def _creation_call(node: cst.With, alias: str | None) -> cst.Call | None:
    """The call of ``with smp.model_creation(...):`` (one item, no ``as``), else None."""
    if alias is None or len(node.items) != 1 or node.items[0].asname is not None:
        return None
    call = node.items[0].item
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and isinstance(call.func.value, cst.Name) and call.func.value.value == alias
            and call.func.attr.value == "model_creation"):
        return None
    return call


def _family(body: cst.CSTNode) -> str | None:
    """The model family, as DeepSpeed's AutoTP names it (``gpt2``, ``llama``), of the Hugging Face class a block
    builds (``GPT2LMHeadModel(config)``, ``transformers.LlamaForCausalLM.from_config(config)``); None when no class
    tells it (``AutoModelForCausalLM``: the family is in the config)."""
    for call in m.findall(body, m.Call()):
        func = call.func  # type: ignore[attr-defined]
        names = []
        while isinstance(func, cst.Attribute):
            names.append(func.attr.value)
            func = func.value
        if isinstance(func, cst.Name):
            names.append(func.value)
        for name in names:
            match = _HF_CLASS.match(name)
            if match and not match.group(1).startswith("Auto"):
                return match.group(1).lower()
    return None


def _with_mark(line: cst.SimpleStatementLine, why: str) -> cst.SimpleStatementLine:
    """``line`` with the port's comment, after the script's own comment when it has one."""
    return line.with_changes(trailing_whitespace=_marked(line.trailing_whitespace, why))


def _marked(end: cst.TrailingWhitespace, why: str) -> cst.TrailingWhitespace:
    """A line's end with the port's comment, after the script's own comment when it has one."""
    own = end.comment
    text = f"{own.value}  {MARK}{why}" if own is not None else MARK + why
    return cst.TrailingWhitespace(whitespace=cst.SimpleWhitespace("  "), comment=cst.Comment(text))


def port_source(source: str, *, config_name: str, microbatches: int, tensor_parallel: int = 1,
                pipeline_parallel: int = 1) -> PortResult:
    """``source`` ported (see the module docstring) for the job's layout (its micro-batches and degrees); raises
    ``cst.ParserSyntaxError`` on a file that does not parse."""
    module = cst.parse_module(source)
    wrapper = cst.MetadataWrapper(module)
    porter = _Porter(wrapper.module, tensor_parallel, pipeline_parallel)
    porter.visit_Module(wrapper.module)
    if porter.alias is None:
        return PortResult(source)
    ported = wrapper.visit(porter)
    # parsed after a statement, so that the block's leading comment stays with it
    helpers = cst.parse_module("pass\n" + _helpers(config_name, microbatches, tensor_parallel)).body[1:]
    body = list(ported.body)
    at = _after_imports(body)
    ported = ported.with_changes(body=[*body[:at], *helpers, *body[at:]])
    return PortResult(ported.code, porter.changes, ported=True, families=list(dict.fromkeys(porter.families)),
                      checkpoints=porter.checkpoints)


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
    lines += [f"- line {c.line}: `{_cell(c.before)}`: {c.after} ([how]({DOCS_LINK}))" for c in result.manual] or [
        "nothing"]
    lines += ["", "## What differs from SMP at this layout", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|").replace("`", "'")
