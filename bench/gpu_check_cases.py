"""The cases of ``bench/gpu_check.py``, one per process: ``python bench/gpu_check_cases.py SPEC_JSON OUT_JSON``.

The parent sets the single-rank ``torch.distributed`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_*``)
and reads the result this process writes to ``OUT_JSON``: ``{"status": "ok" | "failed" | "skipped",
"detail": ..., ...}``. Kinds of case (``spec["case"]``):

* ``gpt2``: an SMP-style GPT-2 script (``smp.init``, ``smp.DistributedModel``, ``smp.DistributedOptimizer``,
  ``@smp.step``, SMP activation checkpointing) with the Hugging Face model kept or replaced by SMP's
  distributed transformer, optionally ``flash_attention=True``; its losses must follow single-process fp32
  Hugging Face training from the same weights on the same data.
* ``gpt2_deepspeed``: the same GPT-2 on native DeepSpeed with the config smp2ds builds (the losses the
  ``gpt2`` cases are held to, by the parent).
* ``time``: median step time of one runner (plain PyTorch, native DeepSpeed, smp2ds; smp2ds with the model
  replaced by SMP's distributed transformer; native DeepSpeed and smp2ds compiled) on the same GPT-2.
* ``profile``: per-operator time of one runner's steps under ``torch.profiler`` (``bench/step_profile.py``).
* ``mlp_compare``: the weights ``examples/train_smp_mlp.py`` dumped against plain PyTorch training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SIZES: dict[str, dict[str, int]] = {
    "124M": {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab": 50257, "seq": 1024, "batch": 8},
    "355M": {"n_layer": 24, "n_head": 16, "n_embd": 1024, "vocab": 50257, "seq": 1024, "batch": 8},
    "tiny": {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab": 512, "seq": 64, "batch": 2},
}
FUNCTIONAL = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab": 256, "seq": 32, "batch": 4}
FUNCTIONAL_STEPS = 5
LOSS_RTOL = {"bf16": 5e-2, "fp16": 2e-2}
"""Losses of 16-bit training against fp32 Hugging Face, relative: bf16 keeps 8 mantissa bits, fp16 11."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LR = 1e-3
FP16_INIT_SCALE = 2.0**16
"""Dynamic loss scaling starts here in all three timing runners (GradScaler's default)."""


def _device(spec: dict) -> torch.device:
    if spec["device"] == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def _gpt2(size: dict[str, int]) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"],
                        vocab_size=size["vocab"], n_positions=size["seq"], resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)  # the same initial weights in every runner
    return GPT2LMHeadModel(config)


def _tokens(size: dict[str, int], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g).to(device)


def _smp_params(precision: str) -> dict[str, Any]:
    return {"ddp": True, "microbatches": 1, precision: True}


def _loss_scale_kwargs(precision: str) -> dict[str, Any]:
    """``smp.DistributedOptimizer``'s loss-scaling arguments for the timing runs (fp16 only)."""
    if precision != "fp16":
        return {}
    return {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": FP16_INIT_SCALE}}


# ---- step-time runners: each returns a closure doing one training step and returning the loss ------------------
def _plain(spec: dict, model: Any, ids: torch.Tensor, device: torch.device) -> Any:
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dtype = DTYPES[spec["precision"]]
    scaler = torch.amp.GradScaler(device.type, init_scale=FP16_INIT_SCALE) if spec["precision"] == "fp16" else None

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss

    return step


def smp2ds_deepspeed_config(smp_params: dict[str, Any], loss_scale: dict[str, Any], world_size: int = 1,
                            ) -> dict[str, Any]:
    """The DeepSpeed config smp2ds builds for ``smp.init(smp_params)`` on ``world_size`` ranks of one node and
    ``smp.DistributedOptimizer(..., **loss_scale)`` (the same code path: translator plan, engine adapter)."""
    from smp2ds.engine.core.deepspeed_config import LossScaleArgs, engine_config
    from smp2ds.translator import Layout, normalize, plan

    layout = Layout(world_size=world_size, gpus_per_node=world_size)
    planned = plan(normalize(smp_params, layout), layout)
    return engine_config(planned.deepspeed, microbatches=int(smp_params.get("microbatches", 1)),
                         loss_scale=LossScaleArgs(**loss_scale))


def _native_engine(precision: str, model: Any, loss_scale: dict[str, Any]) -> Any:
    """``deepspeed.initialize`` with AdamW and the config smp2ds would build."""
    import deepspeed

    config = smp2ds_deepspeed_config(_smp_params(precision), loss_scale)
    if precision == "fp16" and os.environ.get("SMP2DS_ALLOW_CPU_FP16") == "1":
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        if accelerator.device_name() == "cpu":  # what smp2ds does under this variable: PyTorch's CPU fp16 kernels
            accelerator.is_fp16_supported = lambda: True
            accelerator.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
                                      config=config)
    return engine


def _engine_step(engine: Any, ids: torch.Tensor) -> Any:
    """One DeepSpeed training step, as DeepSpeed's documentation writes it."""

    def step() -> torch.Tensor:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    return step


def _smp_step(smp: Any, model: Any, opt: Any, ids: torch.Tensor) -> Any:
    """One step of an SMP script: ``@smp.step`` with ``model.backward``, then ``optimizer.step()``."""

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids)["loss"]
        model.backward(loss)
        return loss

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = train_step(model, ids).reduce_mean()
        opt.step()
        return loss

    return step


def _deepspeed(spec: dict, model: Any, ids: torch.Tensor, device: torch.device) -> Any:
    engine = _native_engine(spec["precision"], model, _loss_scale_kwargs(spec["precision"]))
    spec["_ds_config"] = _ds_param_dict(engine)
    return _engine_step(engine, ids)


def _ds_param_dict(engine: Any) -> dict[str, Any]:
    """The config DeepSpeed runs with (after its own defaults), to show both engines got the same."""
    raw = getattr(getattr(engine, "_config", None), "_param_dict", {}) or {}
    return json.loads(json.dumps(raw, default=str))


def _smp2ds(spec: dict, model: Any, ids: torch.Tensor, device: torch.device) -> Any:
    import smdistributed.modelparallel.torch as smp

    smp.init(_smp_params(spec["precision"]))
    model = smp.DistributedModel(model)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                   **_loss_scale_kwargs(spec["precision"]))
    step = _smp_step(smp, model, opt, ids)
    step()  # builds the engine, so its config can be read; counts as the first warm-up step
    spec["_ds_config"] = _ds_param_dict(model.backend.engine)
    spec["_steps_taken"] = 1
    return step


def _deepspeed_compile(spec: dict, model: Any, ids: torch.Tensor, device: torch.device) -> Any:
    """Native DeepSpeed as in ``_deepspeed``, then its ``engine.compile()`` (the baseline of smp2ds's compile row)."""
    engine = _native_engine(spec["precision"], model, _loss_scale_kwargs(spec["precision"]))
    engine.compile()
    spec["_ds_config"] = _ds_param_dict(engine)
    return _engine_step(engine, ids)


def _smp2ds_compile(spec: dict, model: Any, ids: torch.Tensor, device: torch.device) -> Any:
    """smp2ds with ``SMP2DS_COMPILE=1``: the engine calls DeepSpeed's ``engine.compile()`` before the first step."""
    os.environ["SMP2DS_COMPILE"] = "1"  # this case's own process: read by the engine at the first @smp.step
    return _smp2ds(spec, model, ids, device)


def _smp2ds_dt(spec: dict, model: Any, ids: torch.Tensor, device: torch.device) -> Any:
    """The same GPT-2 replaced by SMP's distributed transformer at tensor_parallel_degree 1 (fused softmax, and
    flash attention through SDPA on cuda), loaded with the kept model's weights; SMP's activation checkpointing
    of every block's attention and output layers, as SMP's GPT-2 example sets it."""
    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_hf_state_dict_to_smdistributed_gpt2

    smp.init(_smp_params(spec["precision"]))
    extras: dict[str, Any] = {"fused_softmax": True, **({"flash_attention": True} if device.type == "cuda" else {})}
    with smp.model_creation(tensor_parallelism=True, **extras):
        replaced = _gpt2(SIZES[spec["size"]])
    replaced = smp.DistributedModel(replaced)
    replaced.load_state_dict(translate_hf_state_dict_to_smdistributed_gpt2(model.state_dict()))
    for block in replaced.get_module().transformer.seq_layers.children():
        smp.set_activation_checkpointing(block.attention)
        smp.set_activation_checkpointing(block.output)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(replaced.parameters(), lr=LR),
                                   **_loss_scale_kwargs(spec["precision"]))
    step = _smp_step(smp, replaced, opt, ids)
    step()  # builds the engine; counts as the first warm-up step
    spec["_steps_taken"] = 1
    spec["_model_class"] = type(replaced.get_module()).__name__
    return step


RUNNERS = {"plain": _plain, "deepspeed": _deepspeed, "smp2ds": _smp2ds, "smp2ds_dt": _smp2ds_dt,
           "deepspeed_compile": _deepspeed_compile, "smp2ds_compile": _smp2ds_compile}


def _warmed_up_runner(spec: dict) -> tuple[Any, torch.device, Any]:
    """(step function, device, synchronise) of ``spec["runner"]`` on the timing GPT-2 after
    ``spec["warmup"]`` steps: every runner has trained the same steps when this returns."""
    device = _device(spec)
    size = SIZES[spec["size"]]
    model = _gpt2(size)
    # activation checkpointing of every block, the same code in all three runners
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = _tokens(size, device)
    step = RUNNERS[spec["runner"]](spec, model, ids, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(spec["warmup"] - spec.get("_steps_taken", 0)):
        step()
    sync()
    return step, device, sync


def time_case(spec: dict) -> dict[str, Any]:
    """Median and best step time of ``spec["runner"]`` after ``spec["warmup"]`` steps."""
    step, device, sync = _warmed_up_runner(spec)
    times = []
    loss = None
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - start)
    result: dict[str, Any] = {"status": "ok", "median_s": statistics.median(times), "best_s": min(times),
                              "steps": len(times), "loss": float(loss.detach()), "ds_config": spec.get("_ds_config")}
    if spec.get("_model_class"):
        result["suspects"] = f"model {spec['_model_class']}"
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["suspects"] = _cuda_suspects(step, device)
    return result


def profile_case(spec: dict) -> dict[str, Any]:
    """Per-step time of every operator of ``spec["runner"]`` under ``torch.profiler`` (after warm-up): device
    self time on cuda, host self time always, and the host wall time of a profiled step."""
    from torch.profiler import ProfilerActivity, profile

    step, device, sync = _warmed_up_runner(spec)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    steps = spec["steps"]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - start) / steps
    ops = []
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", 0.0) or 0.0
        ops.append({"name": event.key, "calls": event.count / steps, "device_ms": device_us / steps / 1e3,
                    "host_ms": event.self_cpu_time_total / steps / 1e3})
    return {"status": "ok", "wall_ms": wall * 1e3, "ops": ops,
            "device_ms": sum(o["device_ms"] for o in ops), "host_ms": sum(o["host_ms"] for o in ops)}


def _cuda_suspects(step: Any, device: torch.device, steps: int = 3) -> str:
    """Causes of slow steps the issue suspects: host synchronisations per step (PyTorch's sync debug mode
    warns at each) and allocator retries (a full cache makes ``cudaMalloc`` fail, free and retry: a sync)."""
    import warnings

    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    try:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught) / steps
    return f"host syncs/step {syncs:g}; allocator retries {retries}"


# ---- functional GPT-2 scripts ------
def _reference_losses(init: dict[str, torch.Tensor], ids: torch.Tensor) -> list[float]:
    """Single-process fp32 Hugging Face training on CPU: the losses smp2ds must follow."""
    model = _gpt2(FUNCTIONAL)
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss

    return _train(step)


def _fp16_static_scale(precision: str) -> dict[str, Any]:
    """fp16 in the functional scripts: a static scale keeps every step (a dynamic one would skip the first
    ones and drift from fp32 training)."""
    return {"static_loss_scale": 1024.0} if precision == "fp16" else {}


def _train(step: Any) -> list[float]:
    return [float(step()) for _ in range(FUNCTIONAL_STEPS)]


def gpt2_deepspeed_case(spec: dict) -> dict[str, Any]:
    """Native DeepSpeed on the functional GPT-2 with the config smp2ds builds: the losses smp2ds must give."""
    model = _gpt2(FUNCTIONAL)
    engine = _native_engine(spec["precision"], model, _fp16_static_scale(spec["precision"]))
    losses = _train(_engine_step(engine, _tokens(FUNCTIONAL, engine.device)))
    return {"status": "ok", "detail": f"{FUNCTIONAL_STEPS} steps, losses {losses[0]:.4f} -> {losses[-1]:.4f}",
            "losses": losses}


def gpt2_case(spec: dict) -> dict[str, Any]:
    """An SMP-style GPT-2 script; ``spec``: precision, transformer ('hf' | 'dt'), flash ('off' | 'on' | 'auto')."""
    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_hf_state_dict_to_smdistributed_gpt2
    from smp2ds.engine.exceptions import SMPUnsupportedError

    device = _device(spec)
    init = _gpt2(FUNCTIONAL).state_dict()
    ids_cpu = _tokens(FUNCTIONAL, torch.device("cpu"))
    want = _reference_losses(init, ids_cpu)
    smp.init(_smp_params(spec["precision"]))
    dt = spec["transformer"] == "dt"
    extras: dict[str, Any] = {"fused_softmax": True} if dt else {}  # an SMP transformer setting: replaced
    if spec["flash"] != "off":
        extras["flash_attention"] = True
    try:
        with smp.model_creation(tensor_parallelism=dt, **extras):
            model = _gpt2(FUNCTIONAL)
        model = smp.DistributedModel(model)
    except SMPUnsupportedError as exc:
        if spec["flash"] == "auto" and "flash_attention" in str(exc):
            return {"status": "skipped", "detail": f"flash_attention not supported here: {exc}"}
        raise
    model.load_state_dict(translate_hf_state_dict_to_smdistributed_gpt2(init) if dt else init)
    blocks = model.get_module().transformer.seq_layers if dt else model.get_module().transformer.h
    for block in blocks.children():  # SMP's activation checkpointing, as its GPT-2 example sets it
        if dt:
            smp.set_activation_checkpointing(block.attention)
            smp.set_activation_checkpointing(block.output)
        else:
            smp.set_activation_checkpointing(block)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                   **_fp16_static_scale(spec["precision"]))
    got = _train(_smp_step(smp, model, opt, ids_cpu.to(device)))
    cls = type(model.get_module()).__name__
    rel = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    problems = []
    if dt and cls != "DistributedTransformerLMHead":
        problems.append(f"model is {cls}, not DistributedTransformerLMHead")
    if not rel <= LOSS_RTOL[spec["precision"]]:
        problems.append(f"losses {got} differ from fp32 Hugging Face {want} by {rel:.3g} relative "
                        f"(allowed {LOSS_RTOL[spec['precision']]})")
    if not got[-1] < got[0]:
        problems.append(f"loss did not fall: {got}")
    detail = f"{cls}; {FUNCTIONAL_STEPS} steps, losses vs fp32 HF max rel diff {rel:.2g}"
    return {"status": "failed" if problems else "ok", "detail": "; ".join(problems) or detail, "losses": got}


def memory_case(spec: dict) -> dict[str, Any]:
    """``smp2ds explain --memory``'s estimate against the measured peak of an SMP-style GPT-2 step (bf16, every
    block checkpointed, AdamW): ``torch.cuda.max_memory_allocated`` on cuda, the live-storage counter on cpu."""
    import contextlib

    import smdistributed.modelparallel.torch as smp
    from smp2ds.engine.memory import estimate_memory, load_model_source
    from smp2ds.engine.memory.measure import LiveTensorBytes
    from smp2ds.engine.memory.step_shape import step_shape
    from smp2ds.translator.normalize import normalize
    from smp2ds.translator.plan_types import Layout
    from smp2ds.translator.planner import plan

    size = SIZES["124M"] if spec["device"] == "cuda" else FUNCTIONAL
    params = _smp_params("bf16")
    model = _gpt2(size)
    config_path = Path(spec["tmp"]) / "gpt2-config.json"
    config_path.write_text(json.dumps({**model.config.to_dict(), "architectures": ["GPT2LMHeadModel"]}))
    layout = Layout(world_size=1, batch_size=size["batch"])
    shape = step_shape(plan(normalize(dict(params), layout), layout), batch_per_rank=size["batch"],
                       seq_len=size["seq"], activation_checkpointing=True)
    estimate = estimate_memory(load_model_source(str(config_path)), shape).peak
    device = _device(spec)
    counter = LiveTensorBytes() if device.type == "cpu" else contextlib.nullcontext()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with counter:
        smp.init(params)
        wrapped = smp.DistributedModel(model)
        for block in wrapped.get_module().transformer.h.children():
            smp.set_activation_checkpointing(block)
        opt = smp.DistributedOptimizer(torch.optim.AdamW(wrapped.parameters(), lr=LR))
        step = _smp_step(smp, wrapped, opt, _tokens(size, device))
        for _ in range(3):
            step()
    measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else counter.peak
    ratio = estimate / measured
    status = "ok" if abs(ratio - 1) <= 0.10 else "failed"
    return {"status": status, "detail": f"estimate {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, "
                                        f"ratio {ratio:.3f} (allowed 0.90-1.10)"}


# ---- the unchanged example script ------
def mlp_compare(spec: dict) -> dict[str, Any]:
    """``examples/train_smp_mlp.py``'s dumped weights against plain PyTorch on the same data and batches."""
    loaded = importlib.util.spec_from_file_location("train_smp_mlp", ROOT / "examples" / "train_smp_mlp.py")
    example = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.make_model()
    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"])
    x, y = example.dataset()
    b = spec["batch"]
    for step in range(spec["steps"]):
        start = (step * b) % x.shape[0]  # one data-parallel rank
        opt.zero_grad(set_to_none=True)
        # micro-batches of equal size: the mean of their mean losses is the full batch's mean loss
        torch.nn.functional.mse_loss(model(x[start:start + b]), y[start:start + b]).backward()
        opt.step()
    got = torch.load(spec["weights"], map_location="cpu")
    want = model.state_dict()
    # per tensor: the largest difference relative to the tensor's largest magnitude
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max()) for k in want)
    tol = spec["rtol"]
    ok = set(got) == set(want) and worst <= tol
    return {"status": "ok" if ok else "failed",
            "detail": f"{spec['steps']} steps, final weights vs plain PyTorch: max diff {worst:.2g} of the "
                      f"tensor's largest weight (allowed {tol})"}


CASES = {"time": time_case, "profile": profile_case, "gpt2": gpt2_case, "gpt2_deepspeed": gpt2_deepspeed_case,
         "mlp_compare": mlp_compare, "memory": memory_case}


def main(argv: list[str]) -> int:
    spec, out = json.loads(argv[1]), Path(argv[2])
    try:
        result = CASES[spec["case"]](spec)
    except Exception as exc:  # noqa: BLE001 - reported as this case's failure; the parent goes on
        traceback.print_exc()
        result = {"status": "failed", "detail": f"{type(exc).__name__}: {exc}"[:600]}
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
