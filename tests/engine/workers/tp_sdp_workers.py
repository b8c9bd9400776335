"""Rank bodies for tensor parallelism x sharded data parallelism (tp 2 x sdp 2 on 4 ranks).

``prescaled_batch: true``: the tensor-parallel group shares rows ``[rdp_rank*b, (rdp_rank+1)*b)`` of
the step's batch, so the single-process reference (``tp_workers.reference``) trains on the union of
the rdp ranks' rows. ``sdp_gradient_clipping`` clips inside DeepSpeed's step (the reference clips
with ``clip_grad_norm_`` at the same value); ``sdp_param_persistence_threshold`` 0 partitions even
these tiny tensors; 2 micro-batches per step (ZeRO-3 reduce-scatters each one's gradients).

Each phase builds a fresh model (``smp.reset()``) and reports what the test checks: losses, full
weights (``state_dict()``), every parameter's elements held by this rank (``ds_tensor``) with its
tensor-parallel and full sizes, whether parameters were born partitioned, the largest number of
elements gathered whole while sharding (measured on DeepSpeed's ``GatheredParameters``), and a
partial ``smp.save`` / ``smp.load`` round trip.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from tests.engine.workers import tp_workers as tw
from tests.engine.workers.train_workers import plain

CONFIG = {"ddp": True, "tensor_parallel_degree": 2, "sharded_data_parallel_degree": 2, "prescaled_batch": True,
          "delayed_parameter_initialization": True, "sdp_param_persistence_threshold": 0,
          "sdp_gradient_clipping": 0.5, "microbatches": 2}
CLIP = CONFIG["sdp_gradient_clipping"]


class _GatherMeter:
    """Counts the elements DeepSpeed gathers whole per ``GatheredParameters`` (the largest, and how often)."""

    def __init__(self) -> None:
        import deepspeed

        self.cls = deepspeed.zero.GatheredParameters
        self.original = self.cls.__init__
        self.largest, self.calls = 0, 0

    def __enter__(self) -> _GatherMeter:
        meter = self

        def init(gp: Any, params: Any, *args: Any, **kwargs: Any) -> None:
            listed = list(params) if not isinstance(params, torch.Tensor) else [params]
            meter.calls += 1
            meter.largest = max(meter.largest, sum(getattr(p, "ds_numel", 0) for p in listed))
            self.original(gp, listed, *args, **kwargs)

        self.cls.__init__ = init
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cls.__init__ = self.original


def _build(smp: Any, phase: dict) -> tuple[Any, torch.nn.Module, dict]:
    kind, out = phase["model"], {}
    delayed = phase.get("delayed", True)
    if kind == "mlp":
        with smp.tensor_parallelism(), smp.delay_param_initialization(enabled=delayed):
            net = tw.MLP()
    else:  # a distributed-transformer setting asks for SMP's replacement (DistributedTransformerLMHead)
        settings = {"fused_softmax": True} if phase.get("transformer") else {}
        with smp.model_creation(tensor_parallelism=True, zero_init=delayed, **settings):
            net = tw.hf_model(kind, phase["seed"])
    out["born_partitioned"] = [hasattr(p, "ds_tensor") and p.data.numel() == 0 for p in net.parameters()]
    out["model_elements"] = sum(getattr(p, "ds_numel", p.numel()) for p in net.parameters())
    with _GatherMeter() as meter:
        model = smp.DistributedModel(net)
    out["gathered_largest"], out["gather_calls"] = meter.largest, meter.calls
    out["module_type"] = type(model.get_module()).__name__
    return model, model.get_module(), out


def _held(net: torch.nn.Module, full: dict) -> dict:
    """name -> (elements this rank holds, tensor-parallel local elements, full elements)."""
    return {n: (p.ds_tensor.numel(), p.ds_numel, full[n].numel()) for n, p in net.named_parameters()}


def _train_phase(smp: Any, phase: dict, b: int) -> dict:
    kind = phase["model"]
    model, net, out = _build(smp, phase)
    out["after_wrap_partitioned"] = all(hasattr(p, "ds_tensor") for p in net.parameters())
    out["dtypes"] = sorted({str(p.dtype) for p in net.parameters()})
    if kind == "mlp":
        model.load_state_dict(tw.plain_model(kind, phase["seed"]).state_dict())  # full tensors, cut here
    opt = smp.DistributedOptimizer(tw.make_optimizer(phase["optimizer"], model.parameters()))
    full = model.state_dict()
    out["held"] = _held(net, full)

    @smp.step
    def train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = tw.loss_of(kind, model, ids)
        model.backward(loss)
        return loss

    rank, ranks = smp.rdp_rank(), smp.rdp_size()
    out["losses"] = []
    for step in range(phase["steps"]):
        ids = tw.global_ids(step, ranks * b)[rank * b:(rank + 1) * b]
        opt.zero_grad()
        out["losses"].append(train_step(model, ids).reduce_mean().item())
        opt.step()
    from smp2ds.engine.mics import partition_stats

    out["stats"] = dict(partition_stats(model.backend.engine))  # gradients, fp32 master, optimizer state held
    out["weights"] = model.state_dict()
    out["local_shapes"] = {k: tuple(v.shape) for k, v in model.local_state_dict().items()
                           if isinstance(v, torch.Tensor)}
    out["data_rank"], out["data_ranks"] = rank, ranks
    if phase.get("checkpoint"):
        out["checkpoint"] = _save_load_round_trip(smp, phase, model, opt, train_step, b)
    return out


def _save_load_round_trip(smp: Any, phase: dict, model: Any, opt: Any, train_step: Any, b: int) -> dict:
    """Partial checkpoint of model and optimizer -> fresh model -> load: the next step equals the
    uninterrupted one (optimizer moments and step count travel with the optimizer). ``checkpoint``:
    ``"save"`` = smp.save(partial=True, v3=True) / smp.load, ``"resume"`` = smp.save_checkpoint /
    smp.resume_from_checkpoint."""
    tmp = os.environ["SMP2DS_TEST_TMPDIR"]
    path = os.path.join(tmp, "tp_sdp_ckpt" if phase["checkpoint"] == "save" else "tp_sdp_resume")
    if phase["checkpoint"] == "save":
        smp.save({"model": model.local_state_dict(), "optimizer": opt.local_state_dict()}, path, partial=True,
                 v3=True)
    else:
        smp.save_checkpoint(path, "t", partial=True, model=model, optimizer=opt)
    smp.barrier()
    rank, ranks = smp.rdp_rank(), smp.rdp_size()
    ids = tw.global_ids(phase["steps"], ranks * b)[rank * b:(rank + 1) * b]
    opt.zero_grad()
    train_step(model, ids)
    opt.step()
    uninterrupted = model.state_dict()
    smp.reset()
    fresh = {**phase, "seed": phase["seed"] + 1000}  # other weights: the checkpoint must replace them
    model, _, _ = _build(smp, fresh)
    opt = smp.DistributedOptimizer(tw.make_optimizer(phase["optimizer"], model.parameters()))
    if phase["checkpoint"] == "save":
        loaded = smp.load(path, partial=True)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        files = sorted(f for f in os.listdir(tmp) if f.startswith("tp_sdp_ckpt"))
    else:
        smp.resume_from_checkpoint(path, tag="t", partial=True)
        files = sorted(os.listdir(os.path.join(path, "t_partial")))

    @smp.step
    def step_again(model: Any, ids: torch.Tensor) -> torch.Tensor:
        loss = tw.loss_of(phase["model"], model, ids)
        model.backward(loss)
        return loss

    opt.zero_grad()
    step_again(model, ids)
    opt.step()
    return {"uninterrupted": uninterrupted, "resumed": model.state_dict(), "files": files}


def run_tp_sdp(phases: list[dict], b: int, overrides: dict | None = None) -> list[dict]:
    """Initialise SMP once (tp 2 x sdp 2, ``CONFIG`` updated by ``overrides``) and train one fresh model
    per phase."""
    import smdistributed.modelparallel.torch as smp

    smp.init({**CONFIG, **(overrides or {})})
    results = []
    for phase in phases:
        smp.reset()
        results.append(_train_phase(smp, phase, b))
    results.append({"ranks": {"tp": (smp.tp_rank(), smp.tp_size()), "rdp": (smp.rdp_rank(), smp.rdp_size()),
                              "shard": (smp.param_shard_rank(), smp.param_shard_size())}})
    smp.barrier()
    return plain(results)


def expected_held(local: int, shard: int) -> int:
    """Elements DeepSpeed's ZeRO-3 keeps per rank of a tensor of ``local`` elements over ``shard`` ranks."""
    return math.ceil(local / shard)
