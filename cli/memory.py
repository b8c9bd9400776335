"""``smp2ds explain FILE --model MODEL --memory`` and ``--fit SIZE``: will a step fit, and which layouts do.

``--memory`` prints each rank role's peak for one training step (``smp2ds.engine.memory``: the model traced on
fake tensors, plus DeepSpeed's model states by formula) and, with ``--gpu-memory``, the verdict. ``--fit`` searches
the layouts the world size allows (pipeline and tensor-parallel degrees, micro-batches, optimizer-state sharding:
ZeRO-1 or sharded data parallelism, activation checkpointing), keeps those whose largest role fits, ranks them
by the bytes each rank sends per step (``smp2ds.translator.tools.estimate`` for the data-parallel traffic,
``tp_traffic`` for tensor parallelism's) and prints the SMP parameters to paste. Both import torch and
transformers; nothing else in the CLI does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from smp2ds.translator.issues import SMPConfigError
from smp2ds.translator.model_state_bytes import model_state_bytes_per_parameter
from smp2ds.translator.plan_types import Layout, Plan, SMPConfig

from . import UsageError
from .report import human_bytes, table

SEQ_HYPERPARAMETERS = ("max_context_width", "seq_length", "max_seq_length", "seq_len", "block_size", "max_length")
"""Hyperparameter names SMP-era scripts use for the sequence length, looked up in this order."""


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    """The flags of the memory estimate (``--model`` and ``--seq-len`` are explain's own)."""
    parser.add_argument("--memory", action="store_true",
                        help="with --model: the peak memory of each rank role (pipeline stage x tp rank) for one "
                        "training step, traced on fake tensors (parameters, gradients, optimizer state, activations, "
                        "DeepSpeed's buckets, transient tensors); --model may also be a model directory or "
                        "module:function")
    parser.add_argument("--fit", metavar="SIZE", help="with --model: propose the layouts of this world size that "
                        "fit a device of SIZE (80GiB, 40GB, h100, a100-40gb, ml.p4d.24xlarge), ranked by "
                        "communication")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="with --memory: the device to judge against (as --fit)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="estimate with every transformer block checkpointed (smp.set_activation_checkpointing)")


def wants_memory(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "memory", False) or getattr(args, "fit", None))


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """DeepSpeed and transformers print on import; stdout is the report (maybe JSON)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def device_from_flag(text: str | None) -> tuple[int, str] | None:
    """(bytes, label) of a ``--gpu-memory`` / ``--fit`` value; a UsageError naming what is allowed."""
    if text is None:
        return None
    # only the memory flags need the device table
    from smp2ds.translator.tools.device_memory import device_bytes

    try:
        return device_bytes(text)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _seq_len(flag: int | None, config: SMPConfig, source: Any) -> tuple[int, str]:
    """(tokens per sample, where from): ``--seq-len``, the hyperparameters, else the model's maximum positions."""
    if flag:
        return int(flag), "--seq-len"
    for name in SEQ_HYPERPARAMETERS:
        value = config.hyperparameters.get(name)
        if value is None:
            continue
        with contextlib.suppress(TypeError, ValueError):
            if int(value) > 0:
                return int(value), f"hyperparameters.{name}"
    if source.default_seq_len:
        return int(source.default_seq_len), "the model's maximum positions"
    raise UsageError("--memory needs a sequence length: pass --seq-len, or set one of the hyperparameters "
                     f"{', '.join(SEQ_HYPERPARAMETERS)}")


def _batch(result: Plan) -> tuple[int, str]:
    batch = result.engine_settings.batch
    if batch.per_rank_batch:
        # the layout's batch is the --batch-size flag's (explain's --world-size / --batch-size make the layout)
        source = batch.source if batch.source and batch.source != "layout" else "--batch-size"
        return int(batch.per_rank_batch), source
    raise UsageError("--memory needs the per-rank batch: pass --batch-size, or set hyperparameters.batch_size "
                     "(or per_device_train_batch_size / train_batch_size) in the configuration")


def _load(model: str) -> Any:
    with _quiet_stdout():
        # torch and transformers load only with --memory / --fit (CLI start-up)
        from smp2ds.engine.memory import load_model_source

        try:
            return load_model_source(model)
        except ValueError as err:
            raise UsageError(f"--model {model}: {err}") from None


def _estimate(source: Any, result: Plan, batch: int, seq: int, ckpt: bool, cache: dict[Any, Any] | None = None) -> Any:
    with _quiet_stdout():
        # torch and transformers load only with --memory / --fit (CLI start-up)
        from smp2ds.engine.memory import estimate_memory
        from smp2ds.engine.memory.step_shape import step_shape  # as above

        try:
            return estimate_memory(source, step_shape(result, batch_per_rank=batch, seq_len=seq,
                                                      activation_checkpointing=ckpt), cache=cache)
        except ValueError as err:
            raise UsageError(f"--memory: {err}") from None


def memory_report(args: argparse.Namespace, config: SMPConfig, result: Plan) -> dict[str, Any]:
    """The ``--memory`` figures as a JSON-ready dict."""
    if not args.model:
        raise UsageError("--memory needs --model (a config.json, a model directory or module:function)")
    source = _load(args.model)
    seq, seq_from = _seq_len(args.seq_len, config, source)
    batch, batch_from = _batch(result)
    estimate = _estimate(source, result, batch, seq, args.activation_checkpointing)
    out = {**estimate.to_dict(), "batch_per_rank": batch, "batch_source": batch_from, "seq_len_source": seq_from,
           "tensor_parallel_degree": result.topology_settings.tensor_parallel_degree}
    device = device_from_flag(args.gpu_memory)
    if device is not None:
        out["device"] = _verdict(estimate, *device)
    out["not_counted"] = not_counted(config)
    return out


def not_counted(config: SMPConfig) -> list[str]:
    """Settings of the configuration the estimate does not model, each with what that means for the figures."""
    found = []
    if config.given.get("offload_activations"):
        found.append("offload_activations: the activations of checkpointed blocks are counted on the device, as "
                     "without offloading (an upper bound for the activation column)")
    return found


def fit_warning(model: str, config: SMPConfig, result: Plan, device: tuple[int, str], *, seq_len: int | None = None,
                activation_checkpointing: bool = False) -> tuple[bool, str]:
    """(fits, one line) for ``validate --model`` and ``doctor --model``: the layout's largest role against
    ``device``. UsageError when the step cannot be sized (no batch, no sequence length, a layout not estimated)."""
    source = _load(model)
    seq, _ = _seq_len(seq_len, config, source)
    batch, _ = _batch(result)
    estimate = _estimate(source, result, batch, seq, activation_checkpointing)
    verdict = _verdict(estimate, *device)

    worst = max(estimate.roles, key=lambda role: role.total)
    line = (f"peak {human_bytes(estimate.peak)} (stage {worst.stage}, batch {batch} x {seq} tokens) against "
            f"{human_bytes(verdict['usable_bytes'])} usable on {verdict['device']}")
    return bool(verdict["fits"]), line


def _verdict(estimate: Any, size: int, label: str) -> dict[str, Any]:
    # torch loads only with --memory / --fit (CLI start-up)
    from smp2ds.engine.memory.estimate import ALLOCATOR_SHARE, CONTEXT_BYTES, usable_bytes

    usable = usable_bytes(size)
    return {"device": label, "bytes": size, "usable_bytes": usable, "context_bytes": CONTEXT_BYTES,
            "allocator_share": ALLOCATOR_SHARE, "fits": estimate.peak <= usable,
            "headroom_bytes": usable - estimate.peak}


_PHASES = {"backward": "forward and backward", "reduce": "last reduce-scatter", "update": "update"}
"""The phases a role peaks in (``RoleMemory.peak_phase``), for people."""
_HELD = {"persistent": "", "step": " [update only]", "backward": " [forward and backward only]",
         "reduce": " [at the last reduce-scatter only]", "transient": ""}
"""When a formula part is held (``StatePart.phase``), for people."""


def render_memory_text(report: Mapping[str, Any]) -> str:
    """The per-role table for people."""

    head = (f"peak memory of one training step: {report['model']}, micro-batch {report['micro_batch']} x "
            f"{report['seq_len']} tokens ({report['dtype']}; batch per rank {report['batch_per_rank']} from "
            f"{report['batch_source']}, sequence from {report['seq_len_source']}), activation checkpointing "
            f"{'on' if report['activation_checkpointing'] else 'off'}\n")
    rows = []
    for role in report["roles"]:
        tp = report["tensor_parallel_degree"]
        rows.append([f"stage {role['stage']}" + (f" x tp 0..{tp - 1}" if tp > 1 else ""),
                     f"{role['first_layer']} .. {role['last_layer']}",
                     human_bytes(role["parameters"]), human_bytes(role["gradients"]), human_bytes(role["optimizer"]),
                     f"{human_bytes(role['activations'])} ({role['micro_batches_in_flight']} mb)",
                     human_bytes(role["buckets"]), human_bytes(role["transient"]), human_bytes(role["total"]),
                     _PHASES[role["peak_phase"]]])
    parts = [head, table(["role", "layers", "params", "grads", "optimizer", "activations", "buckets", "transient",
                          "peak", "peak in"], rows)]
    parts.append("\neach phase's total (the peak is the largest):\n" + "".join(
        f"  stage {role['stage']}: " + ", ".join(f"{_PHASES[name]} {human_bytes(value)}"
                                                 for name, value in role["phases"].items() if value) + "\n"
        for role in report["roles"]))
    formulas = report["roles"][0]["formulas"]
    if formulas:
        parts.append("\nby formula (no tracer sees them), stage 0:\n" + "".join(
            f"  {f['name']}: {human_bytes(f['bytes'])} - {f['reason']}{_HELD[f['phase']]}\n" for f in formulas))
    for line in report.get("not_counted") or []:
        parts.append(f"\nnot modelled: {line}\n")
    device = report.get("device")
    if device:
        verdict = "fits" if device["fits"] else "does NOT fit"
        parts.append(f"\n{verdict} on {device['device']}: usable {human_bytes(device['usable_bytes'])} (less "
                     f"{human_bytes(device['context_bytes'])} for the CUDA context and "
                     f"{device['allocator_share']:.0%} for the allocator), peak {human_bytes(report['peak'])}, "
                     f"headroom {human_bytes(device['headroom_bytes'])}\n")
    return "".join(parts)


# ---- --fit -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    params: dict[str, Any]
    peak: int
    bytes_per_rank: float
    activation_checkpointing: bool
    step: dict[str, Any]
    """``tools/step_time.py``'s estimate: seconds, terms, the deciding term."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


FIT_SHOWN = 5
"""``--fit`` traces layouts fastest first and stops at this many that fit."""

_SEARCHED = ("pipeline_parallel_degree", "partitions", "tensor_parallel_degree", "microbatches", "active_microbatches",
             "shard_optimizer_state", "sharded_data_parallel_degree")
"""Keys ``--fit`` chooses; the configuration's other keys are kept as given."""


def _candidate_params(given: Mapping[str, Any], world: int, batch: int) -> Iterator[dict[str, Any]]:
    keep = {k: v for k, v in given.items() if k not in _SEARCHED}
    own = given.get("microbatches")
    for pp in _divisors(world):
        for tp in _divisors(world // pp):
            dp = world // (pp * tp)
            choices = {1, pp, 2 * pp} | ({int(own)} if isinstance(own, int) else set())
            micro = sorted(m for m in choices if batch % m == 0 and (pp == 1 or m >= pp))
            # optimizer-state sharding: none, ZeRO-1 over the rdp group, or sharded data parallelism over a
            # divisor of it (SMP runs it without pipelines; with tensor parallelism it needs prescaled_batch)
            shardings: list[dict[str, Any]] = [{}] + ([{"shard_optimizer_state": True}] if dp > 1 else [])
            if pp == 1 and tp == 1:
                shardings += [{"sharded_data_parallel_degree": d} for d in _divisors(dp) if d > 1]
            for m in micro:
                for sharding in shardings:
                    yield {**keep, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp, "microbatches": m,
                           "ddp": True, **sharding}


def fit_report(args: argparse.Namespace, config: SMPConfig, result: Plan, layout: Layout) -> dict[str, Any]:
    """Layouts of this world size that fit ``--fit``'s device, fastest per sample first (``tools/step_time.py``).

    Fast at cluster scale: a layout whose model states alone (by formula, the model spread evenly) exceed the
    device is dropped before any trace; layouts that differ only in how model states are sharded share one trace;
    a deep model is traced on a few blocks and scaled (``smp2ds.engine.memory.block_scaling``); a layout the model
    cannot take is skipped with its reason, once per pipeline x tensor-parallel degree."""
    # the traffic model and the planner serve --fit alone
    from smp2ds.translator.normalize import normalize  # as above

    if not args.model:
        raise UsageError("--fit needs --model (a config.json, a model directory or module:function)")
    size, label = device_from_flag(args.fit) or (0, "")
    source = _load(args.model)
    seq, _ = _seq_len(args.seq_len, config, source)
    batch, _ = _batch(result)
    world = result.topology_settings.world_size
    # torch loads only with --memory / --fit (CLI start-up)
    from smp2ds.engine.memory.estimate import tensor_parallel_refusal, usable_bytes  # as above
    from smp2ds.translator.planner import plan  # as above

    usable = usable_bytes(size)
    n_params = source.parameter_count()  # the traffic model's scale: the whole model
    skipped: list[dict[str, Any]] = []
    cut: dict[int, str | None] = {}
    queue: list[tuple[float, int, Candidate, Any]] = []
    pruned = 0
    for index, params in enumerate(_candidate_params(dict(config.given), world, batch)):
        tp = int(params["tensor_parallel_degree"])
        if tp not in cut:
            with _quiet_stdout():
                cut[tp] = tensor_parallel_refusal(source, tp, bool(params.get("prescaled_batch", False)))
        if cut[tp] is not None:
            skipped.append({"smp_parameters": params, "reason": cut[tp]})
            continue
        try:
            candidate_plan = plan(normalize(params, layout), layout)
            floor = _model_state_floor(candidate_plan, n_params, batch, seq)
        except (UsageError, ValueError, RuntimeError) as exc:
            skipped.append({"smp_parameters": params, "reason": str(exc).splitlines()[0]})
            continue
        if floor > usable:
            pruned += 1
            continue
        for ckpt in (False, True):
            timed = _candidate(source, candidate_plan, params, 0, ckpt, n_params, batch, seq)
            queue.append((timed.step["seconds_per_sample"], 2 * index + ckpt, timed, candidate_plan))
    queue.sort(key=lambda item: item[:2])
    cache: dict[Any, Any] = {}
    refused: dict[tuple[int, int], str] = {}
    fitting: list[Candidate] = []
    settled: set[str] = set()  # layouts already traced to fit, or refused
    tried = 0
    for _, _, timed, candidate_plan in queue:
        if len(fitting) == FIT_SHOWN:
            break
        name = json.dumps(timed.params, sort_keys=True)
        degrees = (int(timed.params["pipeline_parallel_degree"]), int(timed.params["tensor_parallel_degree"]))
        if name in settled:
            continue
        if degrees in refused:
            settled.add(name)
            skipped.append({"smp_parameters": timed.params, "reason": refused[degrees]})
            continue
        try:
            estimate = _estimate(source, candidate_plan, batch, seq, timed.activation_checkpointing, cache)
        except (UsageError, ValueError, RuntimeError) as exc:
            # a layout this model cannot take (the engine's SMPUnsupportedError is a RuntimeError: a
            # tensor-parallel degree its heads do not divide, ...): skipped, and named in the report
            reason = str(exc).splitlines()[0]
            if isinstance(exc, RuntimeError):
                refused[degrees] = reason
            settled.add(name)
            skipped.append({"smp_parameters": timed.params, "reason": reason})
            continue
        tried += 1
        if estimate.peak <= usable:
            # without checkpointing it is faster and comes first; with it, only when that did not fit
            settled.add(name)
            fitting.append(dataclasses.replace(timed, peak=estimate.peak))
    from smp2ds.translator.tools.step_time import REFERENCE_DEVICE  # as above

    first_plan = next((p for _, _, t, p in queue if fitting and t.params is fitting[0].params), None)
    return {"device": label, "usable_bytes": usable, "world_size": world, "batch_per_rank": batch, "seq_len": seq,
            "layouts_tried": tried, "layouts_over_by_model_states": pruned, "candidates": len(queue) // 2,
            "skipped": skipped, "step_time_device": REFERENCE_DEVICE.label,
            "fitting": [{"smp_parameters": c.params, "peak": c.peak, "bytes_per_rank": c.bytes_per_rank,
                         "activation_checkpointing": c.activation_checkpointing, "step_time": c.step}
                        for c in fitting],
            "native_deepspeed": _native_exit(first_plan, source) if first_plan is not None else None}


def _native_exit(candidate_plan: Plan, source: Any) -> dict[str, Any]:
    """For users leaving SMP: the native DeepSpeed config of a proposed layout (``convert --to deepspeed --native``)
    and its notes, or why a plain DeepSpeed script cannot run it (pipelines, a family AutoTP refuses)."""
    from smp2ds.translator.tools.native_deepspeed import native_config  # serves --fit alone

    model_type = (source.hf_config or {}).get("model_type")
    try:
        config, notes = native_config(candidate_plan, model_type=model_type if isinstance(model_type, str) else None)
    except SMPConfigError as exc:
        return {"refused": "; ".join(f"{i.message} ({i.hint})" if i.hint else i.message for i in exc.issues)}
    return {"config": config, "notes": notes}


def _model_state_floor(candidate_plan: Plan, n_params: int, batch: int, seq: int) -> float:
    """The least model-state bytes any rank of the layout holds (the parameters spread evenly over the model's
    tensor-parallel and pipeline ranks; ``smp2ds.translator.model_state_bytes``); ValueError for a layout the
    estimate does not cover."""
    # torch loads only with --memory / --fit (CLI start-up)
    from smp2ds.engine.memory.step_shape import step_shape

    shape = step_shape(candidate_plan, batch_per_rank=batch, seq_len=seq, activation_checkpointing=False)
    half = _half(candidate_plan)
    per_rank = n_params / (shape.tensor_parallel * shape.pipeline_stages)
    return per_rank * model_state_bytes_per_parameter(width=2 if half else 4, zero_stage=shape.zero_stage,
                                                      shard=shape.optimizer_shard)


def _candidate(source: Any, candidate_plan: Plan, params: dict[str, Any], peak: int, ckpt: bool, n_params: int,
               batch: int, seq: int) -> Candidate:
    """A fitting layout with what it sends and its step time."""
    from smp2ds.translator.tools.estimate import estimate as traffic  # the traffic model serves --fit alone
    from smp2ds.translator.tools.step_time import StepWork, pipeline_send_bytes, step_time  # as above

    scheme = traffic(candidate_plan, max(n_params, 1))
    chosen = scheme["schemes"][scheme["selected"]]
    model_config = source.hf_config or {}
    tp_bytes = _tensor_parallel_bytes(model_config, candidate_plan, batch, seq)
    topo = candidate_plan.topology_settings
    pp, tp = topo.pipeline_parallel_degree, topo.tensor_parallel_degree
    half = _half(candidate_plan)
    hidden = _config_int(model_config, ("hidden_size", "n_embd", "d_model"))
    sends = pipeline_send_bytes(stages=pp, batch_per_rank=batch, seq_len=seq, hidden=hidden or 0,
                                bytes_per_element=2 if half else 4)
    cross = float(chosen["cross_node_bytes_per_rank"])
    steps = {True: 0, False: 0}  # ring steps across nodes / inside one (an all-reduce is two rings)
    for hop in chosen["hops"]:
        steps[bool(hop["spans_nodes"])] += int(hop["ring_steps"]) * (2 if hop["collective"] == "all_reduce" else 1)
    layers = _config_int(model_config, ("num_hidden_layers", "n_layer", "num_layers")) or 0
    micro = int(candidate_plan.engine_settings.microbatches)
    prescaled = bool(candidate_plan.engine_settings.tensor_parallel.prescaled_batch)
    readers = topo.world_size // (pp * (tp if prescaled else 1))  # ranks that read their own rows
    work = StepWork(parameters=float(n_params), tokens_per_rank=batch * seq, tensor_parallel=tp, pipeline_stages=pp,
                    microbatches=micro,
                    prescaled_batch=prescaled, samples_per_step=readers * batch,
                    activation_checkpointing=ckpt, data_parallel_in_node_bytes=float(chosen["bytes_per_rank"]) - cross,
                    data_parallel_cross_node_bytes=cross, tensor_parallel_bytes=tp_bytes,
                    pipeline_send_bytes=sends, pipeline_crosses_nodes=tp * pp > topo.ranks_per_node,
                    data_parallel_in_node_messages=steps[False], data_parallel_cross_node_messages=steps[True],
                    tensor_parallel_messages=4 * layers * micro * 2 * (tp - 1) if tp > 1 else 0,
                    pipeline_messages=2 * micro if pp > 1 else 0)
    return Candidate(params=params, peak=peak, bytes_per_rank=float(chosen["bytes_per_rank"]) + tp_bytes + sends,
                     activation_checkpointing=ckpt, step=step_time(work))


def _half(plan: Plan) -> bool:
    """True when the plan trains in fp16 or bf16."""
    return plan.engine_settings.precision.dtype != "fp32"


def _config_int(model_config: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    value = next((model_config[k] for k in keys if k in model_config), None)
    return value if isinstance(value, int) else None


def _tensor_parallel_bytes(model_config: Mapping[str, Any], plan: Plan, batch: int, seq: int) -> float:
    """Bytes a rank sends per step for tensor parallelism's all-reduces (``translator/tools/tp_traffic.py``), for a
    Hugging Face config that names its layer count and hidden size; 0 without tensor parallelism."""
    # the tensor-parallel traffic model serves --fit alone
    from smp2ds.translator.tools.tp_traffic import tensor_parallel_traffic

    tp = plan.topology_settings.tensor_parallel_degree
    layers = _config_int(model_config, ("num_hidden_layers", "n_layer", "num_layers"))
    hidden = _config_int(model_config, ("hidden_size", "n_embd", "d_model"))
    if tp == 1 or not isinstance(layers, int) or not isinstance(hidden, int):
        return 0.0
    half = _half(plan)
    found = tensor_parallel_traffic(tp=tp, layers=layers, hidden=hidden, seq_len=seq, batch_per_rank=batch,
                                    microbatches=int(plan.engine_settings.microbatches),
                                    bytes_per_element=2 if half else 4,
                                    prescaled_batch=plan.engine_settings.tensor_parallel.prescaled_batch)
    return float(found["ring_bytes_per_rank_per_step"])


def render_fit_text(report: Mapping[str, Any], limit: int = FIT_SHOWN) -> str:
    """The best layouts, fastest first, with the SMP parameters to paste."""

    shown = min(limit, len(report["fitting"]))
    head = (f"layouts of {report['world_size']} ranks that fit {report['device']} (usable "
            f"{human_bytes(report['usable_bytes'])}), batch per rank {report['batch_per_rank']} x "
            f"{report['seq_len']} tokens: {len(report['fitting'])} of {report['layouts_tried']} traced fit"
            + (f", the best {shown} shown" if shown < len(report["fitting"]) else "") + "\n")
    over = report.get("layouts_over_by_model_states") or 0
    if over:
        head += f"{over} layout(s) left out untraced: their model states alone exceed the device\n"
    skipped = report.get("skipped") or []
    if skipped:
        head += f"skipped {len(skipped)} layout(s) this model cannot take, e.g. {skipped[0]['reason']}\n"
    if not report["fitting"]:
        return head + "none fits: more ranks, a shorter sequence or a smaller per-rank batch\n"
    lines = [head, f"ranked by estimated time per sample on a reference device ({report['step_time_device']}); "
                   "compute and communication not overlapped\n"]
    for i, item in enumerate(report["fitting"][:limit], 1):
        step = item["step_time"]
        lines.append(f"\n{i}. {_seconds(step['seconds_per_sample'])} per sample (a step of "
                     f"{_seconds(step['seconds'])} for {step['samples_per_step']} samples, decided by "
                     f"{step['decided_by']}), peak "
                     f"{human_bytes(item['peak'])}, sends {human_bytes(item['bytes_per_rank'])} per rank and step"
                     + (", with activation checkpointing on every block" if item["activation_checkpointing"] else "")
                     + "\n")
        lines.append("   " + json.dumps(item["smp_parameters"], sort_keys=True) + "\n")
    native = report.get("native_deepspeed")
    if native:
        lines.append("\nthe first as a native DeepSpeed config (a plain deepspeed.initialize script, "
                     "`convert --to deepspeed --native`): " + (json.dumps(native["config"], sort_keys=True)
                                                               if "config" in native else
                                                               f"none: {native['refused']}") + "\n")
    return "".join(lines)


def _seconds(value: float) -> str:
    if value < 1e-3:
        return f"{value * 1e6:.1f} us"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
