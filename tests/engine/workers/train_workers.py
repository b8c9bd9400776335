"""Rank bodies and the plain-PyTorch reference for the multi-rank training tests.

Data: at step s every data-parallel rank r takes rows [r*b, (r+1)*b) of the step's global batch
(SMP: shard by dp_rank), so the reference trains on the union, one global batch per step.
Model init: each rank seeds differently; the engine must broadcast rank 0's weights, so the
reference starts from rank 0's seed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

D_IN, HIDDEN = 8, 16


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1))


def global_batch(step: int, world: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * b, D_IN, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y


def rank_batch(step: int, world: int, b: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, world, b)
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


# ---------------------------------------------------------------------------------------------
# reference
def reference(phase: dict, world: int, b: int, mb: int) -> dict:
    """Single-process training on the union of the ranks' data, plus hand-computed step outputs."""
    model = make_model(phase["seed"])
    opt = make_optimizer(phase["optimizer"], model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if phase.get("scheduler") else None
    bpps = phase.get("bpps", 1)
    norms, per_rank_mb_losses = [], []
    for step in range(phase["steps"]):
        # hand-computed per-micro-batch losses of every rank, with the weights before this step
        with torch.no_grad():
            losses = []
            for r in range(world):
                x, y = rank_batch(step, world, b, r)
                losses.append([F.mse_loss(model(xm), ym).item() for xm, ym in zip(x.chunk(mb), y.chunk(mb))])
            per_rank_mb_losses.append(losses)
        x, y = global_batch(step, world, b)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if (step + 1) % bpps:
            continue
        if step == phase.get("inject_inf_at"):
            opt.zero_grad()  # the distributed run overflows here: its scaler skips the update
            continue
        if phase.get("clip") or phase.get("engine_clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), phase.get("clip") or phase["engine_clip"])))
        opt.step()
        opt.zero_grad()
        if sched:
            sched.step()
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms,
            "mb_losses": per_rank_mb_losses}


def plain(obj: Any) -> Any:
    """Tensors -> numpy arrays: torch's queue pickling shares tensor memory through file
    descriptors that vanish when the worker exits, numpy arrays are copied."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        return (obj.float() if obj.dtype == torch.bfloat16 else obj).numpy()  # numpy has no bfloat16
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


# ---------------------------------------------------------------------------------------------
# rank bodies
def _train_phase(smp: Any, phase: dict, b: int) -> dict:
    rank, world = smp.rank(), smp.dp_size()
    seed = phase["seed"] + (0 if phase.get("same_init") else 17 * rank)
    model = smp.DistributedModel(make_model(seed), backward_passes_per_step=phase.get("bpps", 1))
    opt = smp.DistributedOptimizer(make_optimizer(phase["optimizer"], model.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if phase.get("scheduler") else None
    scaler = smp.amp.GradScaler(init_scale=2.0 ** 8, growth_interval=1000) if phase.get("grad_scaler") else None
    bpps = phase.get("bpps", 1)

    @smp.step
    def train_step(model, x, y, scale=None):
        pred = model(x)
        loss = F.mse_loss(pred, y)
        model.backward(scaler.scale(loss) if scaler else loss)
        return {"loss": loss, "extra": (pred, x.shape[0])}

    out: dict[str, Any] = {"outputs": [], "norms": [], "scales": [], "skipped": []}
    for step in range(phase["steps"]):
        x, y = rank_batch(step, world, b, smp.dp_rank())
        result = train_step(model, x, y)
        so, (pred, sizes) = result["loss"], result["extra"]
        out["outputs"].append({
            "outputs": [t.item() for t in so.outputs], "mean": so.reduce_mean().item(), "sum": so.reduce_sum().item(),
            "stack": so.stack().tolist(), "concat_shape": tuple(pred.concat().shape), "sizes": sizes,
            "type": type(so).__name__, "pred_equal": bool(torch.equal(pred.concat(), torch.cat(pred.outputs))),
        })
        if (step + 1) % bpps:
            continue
        if phase.get("clip"):
            out["norms"].append(float(opt.clip_master_grads(phase["clip"])))
        if scaler:
            if step == phase.get("inject_inf_at", -1):
                for p in model.parameters():
                    p.grad.fill_(math.inf)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            scaler.step(opt)
            out["skipped"].append(all(torch.equal(before[k], v) for k, v in model.state_dict().items()))
            scaler.update()
            out["scales"].append(scaler.get_scale())
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if sched:
            sched.step()
    if phase.get("probe_capabilities"):
        out["capabilities"] = _probe_capabilities(model, opt, rank_batch(0, world, b, smp.dp_rank())[0])
    out["weights"] = model.state_dict()
    out["dtype"] = str(next(model.parameters()).dtype)
    out["is_optimizer"] = isinstance(opt, torch.optim.Optimizer)
    out["lr"] = opt.param_groups[0]["lr"]
    return out


def _probe_capabilities(model: Any, opt: Any, x: torch.Tensor) -> dict:
    """What the core does on the backend's capability flags: a forward outside ``@smp.step`` (refused
    where stages only run in the pipeline schedule) and ``clip_master_grads`` (None where DeepSpeed
    clips inside the step, as SMP did under sharded data parallelism)."""
    try:
        with torch.no_grad():
            model(x)
        forward = "ran"
    except Exception as exc:  # noqa: BLE001 - the test compares the class name
        forward = type(exc).__name__
    norm = opt.clip_master_grads(math.inf)
    from smp2ds.engine.core.state import state

    return {"forward_outside_step": forward, "clip_returns_norm": norm is not None,
            "backend_is_the_plans": model.backend.name == state.plan.engine["backend"]["name"]}


def run_training(config: dict, phases: list[dict], b: int) -> list[dict]:
    """Initialise SMP once, then train one fresh model per phase (smp.reset() in between)."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    results = []
    for phase in phases:
        smp.reset()
        results.append(_train_phase(smp, phase, b))
    smp.barrier()
    return plain(results)


def poisoned_steps(smp: Any, model: Any, opt: Any, b: int, steps: int, inject_at: int,
                   before: Callable[[], dict] = dict, after: Callable[[], dict] = dict) -> list[dict]:
    """``steps`` MSE steps on each rank's rows; at ``inject_at`` only rank 1's loss is multiplied by inf (its
    gradients become inf/nan). Per step: the loss, whether the weights changed, and what ``before`` (read before
    the step) and ``after`` (read after it) add."""

    @smp.step(non_split_inputs=["poison"])
    def train_step(model: Any, x: torch.Tensor, y: torch.Tensor, poison: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss * poison)
        return loss

    record = []
    for step in range(steps):
        x, y = rank_batch(step, smp.dp_size(), b, smp.dp_rank())
        poison = torch.tensor(math.inf if (step == inject_at and smp.rank() == 1) else 1.0)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        seen = before()
        opt.zero_grad()
        loss = train_step(model, x, y, poison).reduce_mean()
        opt.step()
        changed = not all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
        record.append({"loss": loss.item(), "changed": changed, **seen, **after()})
    return record


def run_fp16_overflow(config: dict, b: int, steps: int, inject_at: int) -> dict:
    """fp16 through DeepSpeed's loss scaler: an injected inf skips the step and halves the scale."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    model = smp.DistributedModel(make_model(3))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), static_loss_scale=None,
                                   dynamic_loss_scale=True,
                                   dynamic_loss_args={"init_scale": 2.0 ** 10, "scale_window": 1000,
                                                      "min_scale": 1, "delayed_shift": 1})

    # Only rank 1 overflows: the step must still be skipped on every rank.
    record = poisoned_steps(smp, model, opt, b, steps, inject_at,
                            before=lambda: {"scale_before": opt.loss_scale},
                            after=lambda: {"overflow": opt.overflow, "scale_after": opt.loss_scale,
                                           "dtype": str(next(model.parameters()).dtype)})
    smp.barrier()
    return plain({"record": record, "weights": model.state_dict()})


def run_checkpoint(config: dict, b: int, steps: int, ckpt_dir: str) -> dict:
    """Uninterrupted 2*steps vs. steps + save + fresh model/optimizer + resume + steps."""
    import smdistributed.modelparallel.torch as smp

    smp.init(config)

    def train(model: Any, opt: Any, first: int, count: int) -> None:
        @smp.step
        def train_step(model, x, y):
            loss = F.mse_loss(model(x), y)
            model.backward(loss)
            return loss

        for step in range(first, first + count):
            x, y = rank_batch(step, smp.dp_size(), b, smp.dp_rank())
            opt.zero_grad()
            train_step(model, x, y)
            opt.step()

    def fresh(seed: int, reset: bool = True) -> tuple[Any, Any]:
        if reset:
            smp.reset()
        model = smp.DistributedModel(make_model(seed))
        return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    model, opt = fresh(5)
    train(model, opt, 0, steps)
    smp.save_checkpoint(ckpt_dir, tag="mid", partial=True, model=model, optimizer=opt, user_content={"step": steps})
    smp.save_checkpoint(ckpt_dir, tag="mid_full.pt", partial=False, model=model)
    smp.save({"rank": smp.rank()}, os.path.join(ckpt_dir, "v3obj"), partial=True, v3=True)
    train(model, opt, steps, steps)
    uninterrupted = model.state_dict()

    # resume before the model exists (deferred), as SMP allows, with different initial weights
    smp.reset()
    user_content = smp.resume_from_checkpoint(ckpt_dir, tag=None, partial=True)
    model2, opt2 = fresh(99, reset=False)
    train(model2, opt2, steps, steps)
    folder = os.path.join(ckpt_dir, "mid_partial")
    if not os.path.isdir(folder):  # SMP's sharded-data-parallel layout names the folder by the tag alone
        folder = os.path.join(ckpt_dir, "mid")
    files = sorted(os.listdir(folder))
    with open(os.path.join(ckpt_dir, "newest")) as handle:
        newest = handle.read().split()
    return plain({"uninterrupted": uninterrupted, "resumed": model2.state_dict(), "user_content": user_content,
            "files": files, "newest": newest, "v3": smp.load(os.path.join(ckpt_dir, "v3obj"), partial=True),
            "full_keys": sorted(torch.load(os.path.join(ckpt_dir, "mid_full.pt"), weights_only=False))})
