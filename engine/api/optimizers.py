"""``smp.optimizers``: SMP's ``FusedAdam``, ``FusedLAMB`` and ``FusedNovoGrad``, the apex optimizers SMP shipped
(its BERT and Mask R-CNN examples import them), with apex's arguments, defaults and update rules.

DeepSpeed's fused kernels need CUDA; these run anywhere with torch's tensor ops:

* ``FusedAdam``: torch's ``AdamW`` (apex's default ``adam_w_mode=True``, decoupled weight decay) or ``Adam``
  (``adam_w_mode=False``, L2 weight decay), ``foreach`` when available;
* ``FusedLAMB``: LAMB as apex computes it: gradients scaled down when the global gradient norm exceeds
  ``max_grad_norm``, Adam moments (``grad_averaging`` scales the new gradient by ``1 - beta1``), bias correction,
  decoupled weight decay in ``adam_w_mode``, and each tensor's update scaled by the trust ratio
  ``||w|| / ||update||`` (when weight decay is on, or always with ``use_nvlamb``);
* ``FusedNovoGrad``: NovoGrad as apex computes it: a second moment per tensor (the gradient norm, averaged in
  squares with ``beta2``), the normalised gradient averaged into the first moment, weight decay inside it
  (``reg_inside_moment``) or applied to the weights.

The global gradient norm LAMB clips by is the model's: with pipeline or tensor parallelism each rank holds a part
of the model, so the squared norms of the parts are summed over the model-parallel group (a tensor-parallel
shard counts on every rank, a replicated tensor on tensor-parallel rank 0 only), as SMP's LAMB did; the per-tensor
norms (trust ratios, NovoGrad's second moment) of a shard are its whole tensor's. LAMB's and
NovoGrad's per-tensor norms need whole tensors: ``smp.DistributedOptimizer`` refuses them where DeepSpeed's ZeRO
and bf16 optimizers would hand them flat partitions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.parallel.shards import spec_of


class FusedAdam(torch.optim.Adam):
    """apex ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
    weight_decay=0.0, amsgrad=False, set_grad_none=True)`` on torch's Adam update (decoupled weight decay in
    ``adam_w_mode``, as AdamW; else L2 weight decay added to the gradient)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if not bias_correction:
            raise SMPUnsupportedError("smp.optimizers.FusedAdam(bias_correction=False) is not implemented; "
                                      "allowed: bias_correction=True")
        if amsgrad:
            raise SMPUnsupportedError("smp.optimizers.FusedAdam(amsgrad=True): apex does not support it either")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode, self.set_grad_none = adam_w_mode, set_grad_none


def _model_parallel_sum(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the model-parallel group (pipeline x tensor parallel), when there is one."""
    if not state.initialized or state.groups.topology.mp == 1:
        return value
    return comm.all_reduce(value, group=state.groups.group("mp"))


def _counts_here(param: torch.Tensor) -> bool:
    """Whether this rank counts ``param`` in the model's gradient norm: shards everywhere, replicas once."""
    if not state.initialized or state.groups.topology.tp == 1 or spec_of(param) is not None:
        return True
    return state.groups.coords.tp_rank == 0


def whole_tensor_norms(param: torch.Tensor, *tensors: torch.Tensor) -> list[float]:
    """The L2 norms of ``tensors`` (shaped like ``param``) as whole tensors: for a tensor-parallel shard the
    squares are summed over the tensor-parallel group, so every rank sees the full tensor's norm."""
    squares = torch.stack([t.float().square().sum() for t in tensors])
    if spec_of(param) is not None and state.initialized and state.groups.topology.tp > 1:
        squares = comm.all_reduce(squares, group=state.groups.group("tp"))
    return [float(v) for v in squares.sqrt()]


def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of the whole model's gradient (see the module docstring)."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None and _counts_here(p)]
    # on the parameters' device: the model-parallel all-reduce runs there (NCCL takes no CPU tensors)
    device = params[0].device if params else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total = total + g.detach().float().square().sum()
    return _model_parallel_sum(total).sqrt()


class FusedLAMB(torch.optim.Optimizer):
    """apex ``FusedLAMB(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
    amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
    use_nvlamb=False)``."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False) -> None:
        if amsgrad:
            raise SMPUnsupportedError("smp.optimizers.FusedLAMB(amsgrad=True): apex does not support it either")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "grad_averaging": grad_averaging, "max_grad_norm": max_grad_norm}
        super().__init__(params, defaults)
        self.adam_w_mode, self.use_nvlamb, self.set_grad_none = adam_w_mode, use_nvlamb, set_grad_none

    needs_whole_tensors = True
    """Read by ``smp.DistributedOptimizer``: per-tensor norms need whole tensors, not ZeRO's flat partitions."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        norm = global_grad_norm(p for g in self.param_groups for p in g["params"])
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            max_norm = group["max_grad_norm"]
            clip = float(norm) / max_norm if max_norm > 0 and float(norm) > max_norm else 1.0
            group["step"] = group.get("step", 0) + 1
            t = group["step"]
            c1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
            c2 = 1 - beta2 ** t if group["bias_correction"] else 1.0
            decay = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float() / clip
                w = p.float()
                st = self.state[p]
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(w), torch.zeros_like(w)
                if not self.adam_w_mode and decay:
                    g = g + decay * w
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1 if group["grad_averaging"] else 1.0)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / c1) / ((v / c2).sqrt() + group["eps"])
                if self.adam_w_mode and decay:
                    update = update + decay * w
                ratio = 1.0
                if self.use_nvlamb or decay:
                    w_norm, u_norm = whole_tensor_norms(p, w, update)
                    ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
                p.sub_((group["lr"] * ratio * update).to(p.dtype))
        return loss


class FusedNovoGrad(torch.optim.Optimizer):
    """apex ``FusedNovoGrad(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    weight_decay=0.0, amsgrad=False, reg_inside_moment=False, grad_averaging=True, norm_type=2, init_zero=False,
    set_grad_none=True)``: per tensor, ``v`` is the gradient norm averaged in squares
    (``v = sqrt(beta2 v^2 + (1 - beta2) |g|^2)``, starting from ``|g|``, or from 0 with ``init_zero``); the
    first moment averages ``g / (v / sqrt(1 - beta2^t) + eps)``, plus ``weight_decay * p`` inside it with
    ``reg_inside_moment``, else the decay is applied to the weights directly."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise SMPUnsupportedError("smp.optimizers.FusedNovoGrad(amsgrad=True): apex does not support it either")
        if norm_type != 2:
            raise SMPUnsupportedError(f"smp.optimizers.FusedNovoGrad(norm_type={norm_type}) is not implemented; "
                                      "allowed: norm_type=2 (the L2 norm, apex's default)")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay, "grad_averaging": grad_averaging, "init_zero": init_zero}
        super().__init__(params, defaults)
        self.reg_inside_moment, self.set_grad_none = reg_inside_moment, set_grad_none

    needs_whole_tensors = True
    """Read by ``smp.DistributedOptimizer`` (see :class:`FusedLAMB`)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            group["step"] = group.get("step", 0) + 1
            t = group["step"]
            c1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
            c2 = math.sqrt(1 - beta2 ** t) if group["bias_correction"] else 1.0
            decay = group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, w = p.grad.float(), p.float()
                st = self.state[p]
                norm = torch.tensor(whole_tensor_norms(p, g)[0], device=g.device)
                if not st:
                    st["exp_avg"] = torch.zeros_like(w)
                    st["exp_avg_sq"] = torch.zeros((), device=g.device) if group["init_zero"] else norm.clone()
                v = st["exp_avg_sq"]
                v.copy_((beta2 * v.square() + (1 - beta2) * norm.square()).sqrt())
                update = g / (v / c2 + group["eps"])
                if decay and self.reg_inside_moment:
                    update = update + decay * w
                st["exp_avg"].mul_(beta1).add_(update, alpha=1 - beta1 if group["grad_averaging"] else 1.0)
                step = st["exp_avg"] / c1
                if decay and not self.reg_inside_moment:
                    step = step + decay * w
                p.sub_((group["lr"] * step).to(p.dtype))
        return loss
