"""``smp.DistributedOptimizer``: the DeepSpeed-managed optimizer behind SMP's API.

It *is* a ``torch.optim.Optimizer`` (LR schedulers check that) sharing ``param_groups`` and
``state`` with the optimizer the script built, so changing a group's ``lr`` reaches DeepSpeed,
which keeps using those same group dicts. ``.optimizer`` is that inner optimizer (Hugging Face
builds its scheduler on it under fp16). Creating it builds the DeepSpeed engine.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from smp2ds.engine.core import object_collectives as collectives
from smp2ds.engine.core.backend import Backend
from smp2ds.engine.core.checkpoint_format import PARTIAL_MARK
from smp2ds.engine.core.deepspeed_config import LossScaleArgs
from smp2ds.engine.core.ranks import CommGroup
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import MissingDistributedModelError, SMPInvalidArgumentError, SMPUnsupportedError

_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


def _cpu_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_tree(v) for v in obj)
    return obj


def _check_whole_tensors(optimizer: torch.optim.Optimizer, backend: Any) -> None:
    """Refuse an optimizer that takes each parameter's norm (``smp.optimizers.FusedLAMB``/``FusedNovoGrad`` mark
    themselves ``needs_whole_tensors``) where DeepSpeed hands it flat partitions of many parameters (ZeRO, bf16)."""
    if not getattr(optimizer, "needs_whole_tensors", False):
        return
    stage, precision = backend.zero_stage, backend.precision
    if stage > 0 or precision == "bf16":
        why = f"ZeRO stage {stage}" if stage > 0 else "bf16"
        raise SMPUnsupportedError(
            f"smp.optimizers.{type(optimizer).__name__} takes each parameter's norm, but with {why} DeepSpeed gives "
            "the optimizer flat partitions of many parameters; use it without shard_optimizer_state, sharded data "
            "parallelism and bf16 (fp32 or fp16), or use FusedAdam")


class DistributedOptimizer(torch.optim.Optimizer):
    """``DistributedOptimizer(optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, dynamic_loss_args=None)``.

    The loss-scaling arguments only matter with ``fp16`` (DeepSpeed's fp16 block: dynamic
    scaling skips the step on overflow and lowers the scale).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        static_loss_scale: float | None = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict | None = None,
    ):
        # torch.optim.Optimizer.__init__ is not called: groups and state belong to `optimizer`.
        state.require()
        model = state.model
        if model is None:
            raise MissingDistributedModelError(
                "create smp.DistributedModel(...) before smp.DistributedOptimizer(...), "
                "and build the optimizer from the wrapped model's parameters"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise SMPInvalidArgumentError(
                f"DistributedOptimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise SMPInvalidArgumentError("the optimizer is already a smp.DistributedOptimizer")
        own = {id(p) for p in model.parameters()}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise SMPInvalidArgumentError(
                f"{foreign} optimizer parameter(s) do not belong to the DistributedModel; "
                "create the optimizer from model.parameters() after wrapping"
            )
        _check_whole_tensors(optimizer, model.backend)
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._model = model
        self._steps_taken = 0
        self._group_params = [list(g["params"]) for g in optimizer.param_groups]  # before DeepSpeed swaps them
        self.loss_scale_args = LossScaleArgs(static_loss_scale, bool(dynamic_loss_scale), dynamic_loss_args)
        model.backend.build(optimizer, self.loss_scale_args)
        state.optimizer = self
        model.apply_pending_load()
        if state.pending_optimizer_load is not None:
            pending, state.pending_optimizer_load = state.pending_optimizer_load, None
            pending(self)

    # ---- shared with the inner optimizer ----------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def backend(self) -> Backend:
        return self._model.backend

    @property
    def ds_optimizer(self) -> Any:
        """DeepSpeed's optimizer object (ZeRO / fp16 wrapper, or the inner optimizer for plain DDP)."""
        return self.backend.ds_optimizer

    # ---- the step ------------------------------------------------------------------------------
    def step(self, closure: Callable | None = None) -> None:  # type: ignore[override]
        """One optimizer step at the accumulation boundary (skipped by DeepSpeed on fp16 overflow)."""
        if closure is not None:
            raise SMPUnsupportedError("DistributedOptimizer.step does not take a closure (as in SMP)")
        self._model._optimizer_stepped()
        self.backend.optimizer_step()
        self._steps_taken += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.backend.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of the model's parameters (e.g. unfreezing layers while fine-tuning).

        Where DeepSpeed steps the script's optimizer itself (fp32, no optimizer-state sharding),
        the group is added there and takes part from the next step. Where DeepSpeed keeps its own
        flattened/partitioned copies (ZeRO, fp16/bf16 masters), the engine is rebuilt around the
        optimizer, which is only possible before the first ``step()`` (afterwards the optimizer
        state lives in those copies): later calls are refused.
        """
        params = param_group.get("params") if isinstance(param_group, dict) else None
        if params is None:
            raise SMPInvalidArgumentError(f"add_param_group needs a dict with 'params', got {param_group!r}")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        own = {id(p) for p in self._model.parameters()}
        foreign = sum(1 for p in params if id(p) not in own)
        if foreign:
            raise SMPInvalidArgumentError(
                f"add_param_group: {foreign} parameter(s) of the group do not belong to the DistributedModel")
        present = {id(p) for group in self._group_params for p in group}
        repeated = sum(1 for p in params if id(p) in present)
        if repeated:
            raise SMPInvalidArgumentError(
                f"add_param_group: {repeated} parameter(s) of the group are already in another parameter group")
        if self.ds_optimizer is self.optimizer:
            self.optimizer.add_param_group(param_group)
            self._group_params.append(list(self.optimizer.param_groups[-1]["params"]))
            return
        if self._steps_taken:
            raise SMPUnsupportedError(
                f"add_param_group after the first optimizer.step() with {self.backend.name} "
                f"(zero stage {self.backend.zero_stage}, {self.backend.precision}): DeepSpeed holds the optimizer "
                "state in flattened partitions built from the old groups; add every group before the first step")
        if not self.backend.can_rebuild_optimizer:
            raise SMPUnsupportedError(
                f"add_param_group with the {self.backend.name} backend: its DeepSpeed engine is built once around "
                "the optimizer's groups; create the optimizer with every group")
        self.backend.rebuild(self.optimizer, self.loss_scale_args, lambda: self._regroup(param_group))

    def _regroup(self, param_group: dict[str, Any]) -> None:
        # DeepSpeed replaced the groups' parameters with its own flat copies; give them back the
        # model's parameters and add the group, for DeepSpeed to flatten everything again.
        for group, params in zip(self.optimizer.param_groups, self._group_params, strict=True):
            group["params"] = list(params)
        self.optimizer.state.clear()  # no step yet: nothing to keep
        self.optimizer.add_param_group(param_group)
        self._group_params = [list(g["params"]) for g in self.optimizer.param_groups]

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> torch.Tensor | None:
        """Clip the synchronised gradients at ``max_norm`` in the coming step; returns the total norm
        before clipping (``inf`` on fp16 overflow). Hugging Face logs the returned value.

        With sharded data parallelism it does nothing and returns None, as in SMP: DeepSpeed clips
        inside the step at ``sdp_gradient_clipping``.
        """
        if self.backend.clips_in_step:
            self._warn_sdp_clip(float(max_norm))
            return None
        norm = self.backend.grad_norm(norm_type)
        self.backend.clip_for_next_step(float(max_norm), norm)
        return norm

    def _warn_sdp_clip(self, max_norm: float) -> None:
        configured = self.backend.gradient_clipping
        # inf is how callers ask for the norm alone (Hugging Face's grad-norm logging)
        if math.isfinite(max_norm) and max_norm != configured and not self.__dict__.get("_sdp_clip_warned"):
            self._sdp_clip_warned = True
            warnings.warn(f"clip_master_grads({max_norm}) has no effect with sharded data parallelism (as in SMP): "
                          f"gradients are clipped at sdp_gradient_clipping = {configured}", stacklevel=3)

    def __getattr__(self, name: str) -> Any:
        """Attributes this wrapper lacks come from DeepSpeed's optimizer (SMP returned DeepSpeed's ZeRO
        optimizer under sharded data parallelism: ``fp32_partitioned_groups_flat``,
        ``_global_grad_norm``, ...), then from the script's optimizer (SMP patched that one in place)."""
        if name.startswith("__") or name in ("optimizer", "_model"):
            raise AttributeError(name)
        targets = []
        model = self.__dict__.get("_model")
        if model is not None and model.backend.ds_optimizer is not None:
            targets.append(model.backend.ds_optimizer)
        if "optimizer" in self.__dict__:
            targets.append(self.__dict__["optimizer"])
        for target in targets:
            try:
                return getattr(target, name)
            except AttributeError:
                continue
        raise AttributeError(f"'DistributedOptimizer' object (nor the optimizers it wraps: "
                             f"{', '.join(type(t).__name__ for t in targets)}) has no attribute {name!r}")

    @property
    def overflow(self) -> bool:
        """True when the last step was skipped because fp16 gradients overflowed."""
        return self.backend.overflow

    @property
    def loss_scale(self) -> float:
        return self.backend.loss_scale

    @property
    def loss_scaler(self) -> Any:
        return getattr(self.ds_optimizer, "loss_scaler", None)

    # ---- state dicts --------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {
            "zero_stage": self.backend.zero_stage,
            "precision": self.backend.precision,
            "rdp_rank": state.groups.coords.rdp_rank,
            "rdp_size": state.groups.topology.rdp,
        }

    def _position_names(self) -> list[list[str]] | None:
        """Per parameter group, the name of each parameter the saved state numbers by position (PyTorch's own
        optimizer state: unsharded fp32), so offline tools match state to parameters however the script grouped
        them; None where the state is DeepSpeed's flat partitions or a parameter has no name here."""
        opt = self.ds_optimizer
        if opt is not self.optimizer:
            return None
        names = {id(p): n for n, p in self._model.get_module().named_parameters()}
        groups = [[names.get(id(p)) for p in group["params"]] for group in opt.param_groups]
        return None if any(n is None for group in groups for n in group) else groups  # type: ignore[return-value]

    def local_state_dict(
        self, cast_to_cpu: bool = True, gather_if_shard: bool = True, fp32_states_only: bool = False
    ) -> dict[str, Any]:
        """This rank's optimizer state (its ZeRO partition with ``shard_optimizer_state``); the ``smp2ds`` entry
        also names the parameters of each group where the state numbers them by position."""
        sd = self.backend.optimizer_state_dict()
        meta = self._meta()
        names = self._position_names()
        if names is not None:
            meta["param_names"] = names
        return {"ds_optimizer": _cpu_tree(sd) if cast_to_cpu else sd, "smp2ds": meta, PARTIAL_MARK: True}

    local_optimizer_state_dict = local_state_dict

    def state_dict(self, cast_to_cpu: bool = True, fp32_states_only: bool = False) -> dict[str, Any]:  # type: ignore[override]
        """The whole optimizer state: with ``shard_optimizer_state`` every rank's partition, gathered."""
        local = self.local_state_dict(cast_to_cpu)
        if not self.backend.optimizer_state_is_sharded:
            return {**local, PARTIAL_MARK: False}
        parts = collectives.allgather(local, CommGroup.RDP_GROUP)
        return {"partitions": parts, "smp2ds": self._meta(), PARTIAL_MARK: False}

    def load_state_dict(self, state_dict: dict[str, Any], gather_if_shard: bool = False) -> None:  # type: ignore[override]
        """Load what ``state_dict``/``local_state_dict`` produced (or a plain PyTorch optimizer dict)."""
        sd = state_dict
        if "partitions" in sd:
            sd = sd["partitions"][state.groups.coords.rdp_rank]
        if "ds_optimizer" not in sd:
            if self.backend.zero_stage == 0 and self.backend.precision == "fp32" and "param_groups" in sd:
                self.optimizer.load_state_dict(sd)
                return
            raise SMPInvalidArgumentError(
                "not an smp2ds optimizer state dict (expected the output of "
                "DistributedOptimizer.state_dict() or local_state_dict())"
            )
        meta = sd.get("smp2ds", {})
        if meta.get("zero_stage", self.backend.zero_stage) != self.backend.zero_stage:
            raise SMPInvalidArgumentError(
                f"optimizer state was saved with ZeRO stage {meta.get('zero_stage')} but this "
                f"run uses stage {self.backend.zero_stage} (shard_optimizer_state changed)"
            )
        self.backend.load_optimizer_state_dict(sd["ds_optimizer"])

    load_local_optimizer_state_dict = load_state_dict

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("DistributedOptimizer cannot be pickled; save state_dict()/local_state_dict() instead")
