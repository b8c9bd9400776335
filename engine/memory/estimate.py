"""Peak memory of each rank role for one training step: traced parts plus DeepSpeed's formulas.

A rank role is a pipeline stage; its tensor-parallel ranks hold equal shapes and share one figure.
Each stage is traced once (:mod:`.step_trace`) for one micro-batch: the whole model without pipelines,
else the stage's layers of the engine's own layer list, split by the engine's partitioner. A stage of
a 1F1B schedule keeps ``min(stages - stage, microbatches)`` micro-batches' activations in flight, so
the stage's peak adds the saved activations of the others to the traced peak. Under sharded data parallelism
(ZeRO-3 inside MiCS shard groups) the trace holds no gradient before backward and :mod:`.zero3_states` turns
its whole parameters and gradients into DeepSpeed's partitions, gathered parameters and reduce bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from smp2ds.engine.core.activation_checkpointing import checkpoint_forward
from smp2ds.engine.memory.block_scaling import (
    HIGH,
    LOW,
    SCALE_ABOVE,
    BlockSpan,
    block_span,
    counts_for,
    scale_count,
    scale_trace,
    stage_segment,
)
from smp2ds.engine.memory.model_source import ModelSource
from smp2ds.engine.memory.model_states import StatePart, model_states
from smp2ds.engine.memory.step_trace import StepTrace, trace_step
from smp2ds.engine.memory.tensor_parallel import fake_group, shard
from smp2ds.engine.memory.zero3_states import census, zero3_states
from smp2ds.engine.pipeline.layers import build_layer_list
from smp2ds.engine.pipeline.partition_plan import plan_partition

GIB = 1 << 30
CONTEXT_BYTES = 1 * GIB
"""Kept back from the device for the CUDA context, NCCL's buffers and the kernels' workspaces."""
ALLOCATOR_SHARE = 0.05
"""Kept back for the caching allocator's fragmentation."""


@dataclass(frozen=True)
class RoleMemory:
    """One pipeline stage's peak (every tensor-parallel rank of it alike)."""

    stage: int
    layers: tuple[str, str]
    """First and last layer of the stage."""
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buckets: int
    transient: int
    in_flight: int
    """Micro-batches whose activations this stage holds at its peak."""
    elements: int
    """Parameters this rank holds."""
    parts: tuple[StatePart, ...] = field(default_factory=tuple)

    def _held(self, phase: str) -> int:
        return sum(p.bytes for p in self.parts if p.phase == phase)

    @property
    def backward_peak(self) -> int:
        """Forward and backward: the traced peak with the model states held through the step."""
        return (self.parameters + self.gradients + self.activations + self.transient + self._held("persistent")
                + self._held("backward"))

    @property
    def reduce_peak(self) -> int:
        """ZeRO-3's last reduce-scatter, when backward ends (activations freed, the bucket's copies made); 0
        without ZeRO-3."""
        reduce = self._held("reduce")
        return self.parameters + self.gradients + self._held("persistent") + reduce if reduce else 0

    @property
    def update_peak(self) -> int:
        """Gradient reduction and update, activations freed: the parts allocated only then."""
        return self.parameters + self.gradients + self._held("persistent") + self._held("step")

    @property
    def peak_phase(self) -> str:
        """``backward``, ``reduce`` or ``update``: where the role peaks."""
        phases = {"backward": self.backward_peak, "reduce": self.reduce_peak, "update": self.update_peak}
        return max(phases, key=lambda name: phases[name])

    @property
    def total(self) -> int:
        """The role's peak: the largest of the phases."""
        return max(self.backward_peak, self.reduce_peak, self.update_peak)

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "first_layer": self.layers[0], "last_layer": self.layers[1],
                "parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "buckets": self.buckets, "transient": self.transient,
                "total": self.total, "peak_phase": self.peak_phase,
                "phases": {"backward": self.backward_peak, "reduce": self.reduce_peak, "update": self.update_peak},
                "micro_batches_in_flight": self.in_flight, "parameters_held": self.elements,
                "formulas": [{"name": p.name, "bytes": p.bytes, "reason": p.reason, "phase": p.phase}
                             for p in self.parts]}


@dataclass(frozen=True)
class MemoryEstimate:
    """Every role's peak and the step it was traced for."""

    model: str
    roles: tuple[RoleMemory, ...]
    micro_batch: int
    seq_len: int
    dtype: str
    activation_checkpointing: bool

    @property
    def peak(self) -> int:
        return max(role.total for role in self.roles)

    def fits(self, device_bytes: int) -> bool:
        """True when the largest role fits ``device_bytes`` less the context and allocator margin."""
        return self.peak <= usable_bytes(device_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "micro_batch": self.micro_batch, "seq_len": self.seq_len, "dtype": self.dtype,
                "activation_checkpointing": self.activation_checkpointing, "peak": self.peak,
                "roles": [role.to_dict() for role in self.roles]}


def usable_bytes(device_bytes: int) -> int:
    """What a training step may use of a device of ``device_bytes``."""
    return int((device_bytes - CONTEXT_BYTES) * (1 - ALLOCATOR_SHARE))


@dataclass(frozen=True)
class StepShape:
    """The layout and step the estimate is for (from the plan and the flags)."""

    pipeline_stages: int = 1
    tensor_parallel: int = 1
    microbatches: int = 1
    batch_per_rank: int = 1
    seq_len: int = 1024
    dtype: torch.dtype = torch.float32
    zero_stage: int = 0
    optimizer_shard: int = 1
    zero_config: Mapping[str, Any] = field(default_factory=dict)
    activation_checkpointing: bool = False
    memory_weight: float = 0.8
    replicas: int = 1
    """Sharded data parallelism: the MiCS replica groups' size (dp / ``optimizer_shard``)."""
    backend: str = "nccl"
    """The collectives' backend: ``gloo`` (CPU ranks) copies a reduce-scatter's input once more."""
    prescaled_batch: bool = False
    """SMP's ``prescaled_batch``: False (its default) gathers the tensor-parallel group's batches in each block."""


TraceCache = dict[tuple[Any, ...], Any]
"""What ``estimate_memory(..., cache=)`` keeps for one model source across layouts (``--fit``): each shape's traced
stages (layouts that differ only in how model states are sharded share them), the whole model of a tensor-parallel
degree (its partition and census) and the traces of a small model's layer stretches (pipelines of other degrees
reuse them)."""


def estimate_memory(source: ModelSource, shape: StepShape, *, cache: TraceCache | None = None,
                    scale: bool = True) -> MemoryEstimate:
    """Trace ``source``'s model for ``shape`` on fake tensors and add the model-state formulas.

    ``cache``: traces kept across calls for one ``source``. ``scale``: a model of more than
    ``block_scaling.SCALE_ABOVE`` blocks built from a Hugging Face config is traced on a few blocks and scaled
    (:mod:`.block_scaling`, exact for alike blocks); False traces every block."""
    if shape.batch_per_rank % shape.microbatches:
        raise ValueError(f"the per-rank batch {shape.batch_per_rank} is not divisible by microbatches "
                         f"{shape.microbatches}")
    micro = shape.batch_per_rank // shape.microbatches
    sharded = shape.zero_stage == 3
    if sharded and shape.pipeline_stages > 1:
        raise ValueError("sharded data parallelism with pipeline stages is not estimated")
    key = (shape.pipeline_stages, shape.tensor_parallel, micro, shape.seq_len, shape.dtype,
           shape.activation_checkpointing, shape.memory_weight, shape.prescaled_batch, sharded, scale)
    if cache is not None and key in cache:
        stages, model = cache[key]
    else:
        stages, model = _traced_stages(source, shape, micro, scale=scale, cache=cache if cache is not None else {})
        if cache is not None:
            cache[key] = (stages, model)
    half = shape.dtype in (torch.float16, torch.bfloat16)
    elem = torch.tensor([], dtype=shape.dtype).element_size()
    roles = []
    for index, (names, elements, trace) in enumerate(stages):
        in_flight = min(shape.pipeline_stages - index, shape.microbatches) if shape.pipeline_stages > 1 else 1
        activations = trace.peak_activations + (in_flight - 1) * trace.saved_activations
        transient = trace.peak - trace.parameters - trace.gradients - trace.peak_activations
        parameters, gradients, shown = trace.parameters, trace.gradients, []
        if sharded:
            assert model is not None  # built whole for the census under sharded data parallelism
            found = census([model], shape.optimizer_shard, shape.zero_config)
            z3 = zero3_states(found, element_size=elem, shard=shape.optimizer_shard, replicas=shape.replicas,
                              zero_config=shape.zero_config, traced_gradients=trace.gradients,
                              final_gradients=trace.final_gradients, final_held=trace.final_held,
                              reduce_scatter_copies=2 if shape.backend == "gloo" else 1)
            optimizer, buckets, shown, bucket_bytes = z3.optimizer, z3.buckets, z3.shown, z3.bucket_bytes()
            parameters = trace.parameters - found.whole_bytes + elem * found.partition + found.persistent_bytes
            gradients = elem * found.partition  # the flat gradient partition, in the training dtype
            transient += found.gathered_bytes
            elements = found.partition
        else:
            optimizer, buckets = model_states(elements=elements, grad_bytes_per_element=elem, half=half,
                                              zero_stage=shape.zero_stage, shard=shape.optimizer_shard,
                                              zero_config=shape.zero_config)
            bucket_bytes = sum(p.bytes for p in buckets)
        roles.append(RoleMemory(stage=index, layers=names, parameters=parameters, gradients=gradients,
                                optimizer=sum(p.bytes for p in optimizer), activations=activations,
                                buckets=bucket_bytes, transient=max(transient, 0),
                                in_flight=in_flight, elements=elements, parts=tuple(optimizer + buckets + shown)))
    return MemoryEstimate(model=source.description, roles=tuple(roles), micro_batch=micro, seq_len=shape.seq_len,
                          dtype=str(shape.dtype).replace("torch.", ""),
                          activation_checkpointing=shape.activation_checkpointing)


def tensor_parallel_refusal(source: ModelSource, tp: int, prescaled_batch: bool = False) -> str | None:
    """Why the engine cannot cut ``source``'s model over ``tp`` ranks (a degree its heads do not divide, ...), or
    None when it can: one block is built and cut on fake tensors (the whole model when it has no block count)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if tp == 1:
        return None
    built_from = source.with_blocks(1) if source.blocks is not None else source
    try:
        with fake_group(tp) as group, FakeTensorMode(allow_non_fake_inputs=True):
            shard(built_from.build(), group, tp, prescaled_batch)
    except (RuntimeError, ValueError) as exc:  # the engine's SMPUnsupportedError is a RuntimeError
        return str(exc).splitlines()[0]
    return None


def _traced_stages(source: ModelSource, shape: StepShape, micro: int, *, scale: bool,
                   cache: TraceCache) -> tuple[list[Stage], nn.Module | None]:
    """Each stage's (layers, parameters held, trace), and the whole model when sharded data parallelism needs its
    census (else None where only small models were built). ``cache`` keeps, besides whole estimates, the whole
    model of a tensor-parallel degree and the traces of small models' layer stretches, shared across layouts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sharded = shape.zero_stage == 3
    blocks = source.blocks if scale else None
    tp = shape.tensor_parallel
    with fake_group(tp) if tp > 1 else contextlib.nullcontext() as group, FakeTensorMode(allow_non_fake_inputs=True):

        def build(built_from: ModelSource, checkpointed: bool = True) -> nn.Module:
            with _default_dtype(shape.dtype):  # fake tensors cannot be converted: built (and replaced) in the dtype
                model = built_from.build().train()
                if tp > 1:
                    shard(model, group, tp, shape.prescaled_batch)
            if shape.activation_checkpointing and checkpointed:
                checkpoint_blocks(model)
            return model

        if blocks is not None and blocks[1] > SCALE_ABOVE and _builds_small(source, build):
            whole = None
            if sharded or shape.pipeline_stages > 1:
                # parameter counts only (the partition, the census): built once per degree and dtype
                whole_key = ("whole", tp, shape.dtype, shape.prescaled_batch)
                if whole_key not in cache:
                    cache[whole_key] = build(source, checkpointed=False)  # type: ignore[assignment]
                whole = cache[whole_key]  # type: ignore[assignment]
            if shape.pipeline_stages == 1:
                return [_scaled_whole_model(source, build, micro, shape.seq_len, blocks[1], sharded)], whole
            assert whole is not None
            stages = _scaled_pipeline_stages(whole, lambda: build(source.with_blocks(SCALE_ABOVE)), source, shape,
                                             micro, cache)
            if stages is not None:
                return stages, whole
        model = build(source)
        inputs = source.make_inputs(model, micro, shape.seq_len)
        if shape.pipeline_stages == 1:
            return [_whole_model(model, inputs, preallocate_grads=not sharded)], model
        return _pipeline_stages(model, inputs, shape), model


def _builds_small(source: ModelSource, build: Any) -> bool:
    """True when the model builds with fewer blocks (a config whose other settings depend on the block count in a
    way :meth:`ModelSource.with_blocks` does not know refuses it: then the model is traced whole)."""
    try:
        build(source.with_blocks(LOW))
    except Exception:  # noqa: BLE001 - transformers' config validation raises its own classes; the whole trace
        return False  # then runs and raises whatever is really wrong (a degree the heads refuse, ...)
    return True


def _scaled_whole_model(source: ModelSource, build: Any, micro: int, seq_len: int, blocks: int,
                        sharded: bool) -> Stage:
    """The whole model's trace from models of ``LOW`` and ``HIGH`` blocks."""
    traced = []
    for count in (LOW, HIGH):
        model = build(source.with_blocks(count))
        traced.append(_whole_model(model, source.make_inputs(model, micro, seq_len), preallocate_grads=not sharded))
    (names, low_elements, low), (_, high_elements, high) = traced
    return names, scale_count(low_elements, high_elements, blocks), scale_trace(low, high, blocks)


Stage = tuple[tuple[str, str], int, StepTrace]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors made inside default to ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _elements(modules: list[nn.Module]) -> int:
    seen = {id(p): p.numel() for m in modules for p in m.parameters()}
    return sum(seen.values())


def _whole_model(model: nn.Module, inputs: dict[str, Any], *, preallocate_grads: bool = True) -> Stage:
    held: list[Any] = []

    def run() -> Any:
        out = model(**inputs)
        held.append(out)  # the script holds the model's output (its logits) until its step function returns
        loss = getattr(out, "loss", None)
        if loss is not None:
            return loss
        value = out if isinstance(out, torch.Tensor) else out[0]
        return value.float().mean()

    names = [n for n, _ in model.named_children()]
    trace = trace_step(run, [model], preallocate_grads=preallocate_grads)
    held.clear()
    return (names[0], names[-1]), _elements([model]), trace


def checkpoint_blocks(model: nn.Module) -> None:
    """Checkpoint each block of the model's block list (its largest ``nn.ModuleList``), as a script does with
    ``smp.set_activation_checkpointing(block)`` for each block after wrapping."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no block list (nn.ModuleList) to checkpoint")
    for block in max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters())):
        checkpoint_forward(block)


def _call(entry: Any, x: Any, built: dict[str, nn.Module]) -> Any:
    from deepspeed.pipe import TiedLayerSpec

    if isinstance(entry, TiedLayerSpec):
        if entry.key not in built:
            built[entry.key] = entry.build()
        return entry.forward_fn(built[entry.key], x) if entry.forward_fn else built[entry.key](x)
    return entry(x)


def _stage_input(x: Any) -> Any:
    def own(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach().clone()
        return t.requires_grad_() if t.is_floating_point() else t

    return tuple(own(t) for t in x) if isinstance(x, tuple) else own(x)


def _pipeline_stages(model: nn.Module, inputs: dict[str, Any], shape: StepShape) -> list[Stage]:
    """Each stage traced in order; a stage's traced output is the next stage's input, and a stage of the same
    layer classes, place and input shapes as one already traced reuses its trace (a middle stage of blocks)."""
    layer_list = build_layer_list(model)
    plan = plan_partition(layer_list, shape.pipeline_stages, memory_weight=shape.memory_weight)
    layers = layer_list.layers
    built: dict[str, nn.Module] = {}
    out: list[Stage] = []
    cache: dict[tuple, tuple[StepTrace, Any]] = {}
    last = len(layers) - 1
    x = layer_list.adapter.pipe_inputs((), inputs)
    for info in plan.stages:
        stage_layers = layers[info.start:info.stop]
        key = (info.start == 0, info.stop - 1 == last, _signature(x),
               tuple(type(layer.entry).__name__ for layer in stage_layers))
        modules = [m for layer in stage_layers for m in layer.modules]
        if key not in cache:
            produced: list[Any] = []
            run = _stage_run(layer_list, inputs, x, info.start, info.stop, built, produced)
            trace = trace_step(run, modules)
            cache[key] = (trace, produced[0] if produced and info.stop - 1 != last else None)
            produced.clear()
        trace, x = cache[key]
        out.append(((stage_layers[0].name, stage_layers[-1].name), _elements(modules), trace))
    return out


def _scaled_pipeline_stages(whole: nn.Module, build_small: Any, source: ModelSource, shape: StepShape, micro: int,
                            cache: TraceCache) -> list[Stage] | None:
    """Each stage of ``whole``'s partition traced on a small model (the same with ``SCALE_ABOVE`` blocks, built by
    ``build_small`` when a stretch is not yet in ``cache``): the stage's own first and last layers with up to
    ``HIGH`` blocks, scaled to the stage's block count (:mod:`.block_scaling`). None when the layer lists do not
    have one run of alike blocks (traced whole then)."""
    whole_list = build_layer_list(whole)
    whole_span = block_span([layer.name for layer in whole_list.layers])
    if whole_span is None:
        return None
    small_span = BlockSpan(head=whole_span.head, count=SCALE_ABOVE, tail=whole_span.tail)
    plan = plan_partition(whole_list, shape.pipeline_stages, memory_weight=shape.memory_weight)
    small: dict[str, Any] = {}

    def trace_of(start: int, stop: int) -> StepTrace | None:
        key = ("stretch", shape.tensor_parallel, shape.dtype, shape.prescaled_batch, shape.activation_checkpointing,
               micro, shape.seq_len, start, stop)
        if key not in cache:
            if not small:
                model = build_small()
                layer_list = build_layer_list(model)
                if block_span([layer.name for layer in layer_list.layers]) != small_span:
                    return None
                small.update(list=layer_list, inputs=source.make_inputs(model, micro, shape.seq_len), built={})
            layer_list, built = small["list"], small["built"]
            first_input = _input_of(layer_list, small["inputs"], start, built)
            run = _stage_run(layer_list, small["inputs"], first_input, start, stop, built, [])
            cache[key] = trace_step(run, [m for layer in layer_list.layers[start:stop]  # type: ignore[assignment]
                                          for m in layer.modules])
        return cache[key]  # type: ignore[return-value]

    out: list[Stage] = []
    for info in plan.stages:
        stage_blocks = max(0, min(info.stop, whole_span.head + whole_span.count) - max(info.start, whole_span.head))
        found = []
        for count in counts_for(stage_blocks):
            segment = stage_segment(info.start, info.stop, whole_span, small_span, count)
            trace = trace_of(segment.start, segment.stop) if segment is not None else None
            if trace is None:
                return None
            found.append(trace)
        trace = found[0] if len(found) == 1 else scale_trace(found[0], found[1], stage_blocks)
        stage_layers = whole_list.layers[info.start:info.stop]
        out.append(((stage_layers[0].name, stage_layers[-1].name),
                    _elements([m for layer in stage_layers for m in layer.modules]), trace))
    return out


def _input_of(layer_list: Any, inputs: dict[str, Any], start: int, built: dict[str, nn.Module]) -> Any:
    """What layer ``start`` receives: the model's inputs through the layers before it, untraced."""
    x = layer_list.adapter.pipe_inputs((), inputs)
    with torch.no_grad():
        for i in range(start):
            x = _call(layer_list.layers[i].entry, x, built)
    return _detached(x)


def _signature(x: Any) -> tuple:
    items = x if isinstance(x, tuple) else (x,)
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in items)


def _detached(x: Any) -> Any:
    def own(t: Any) -> Any:
        return t.detach() if isinstance(t, torch.Tensor) else t

    return tuple(own(t) for t in x) if isinstance(x, tuple) else own(x)


def _stage_run(layer_list: Any, inputs: dict[str, Any], first_input: Any, start: int, stop: int,
               built: dict[str, nn.Module], produced: list[Any]) -> Any:
    """The stage's forward for the tracer; a stage before the last records its output (the next one's input)."""
    layers = layer_list.layers
    last = len(layers) - 1

    def run() -> Any:
        x = _stage_input(first_input)
        for i in range(start, stop):
            x = _call(layers[i].entry, x, built)
        if stop - 1 == last:
            result = layer_list.adapter.make_output(x, (), inputs)
            produced.append(result)  # the output (logits) stays alive through the backward, as the script holds it
            return result.loss if getattr(result, "loss", None) is not None else result
        produced.append(_detached(x))
        return x

    return run
