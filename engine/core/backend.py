"""The ``Backend`` protocol: what ``DistributedModel``, ``DistributedOptimizer``, ``smp.step`` and
the checkpoint code ask of the parallelism that runs the model.

One backend per kind of DeepSpeed engine it drives: plain (``data_parallel``: DDP or ZeRO-1), ZeRO-3 over
MiCS shard groups (``mics``) and the pipeline engine (``pipeline``), each with or without a model that
tensor parallelism sharded (``tensor_parallel.parallelize``, handed over as a
:class:`~smp2ds.engine.core.tensor_parallel_view.TensorParallelView`), built by
:mod:`smp2ds.engine.api.backend_factory` as the Plan says. Backends share code through functions
(:mod:`smp2ds.engine.core.deepspeed_optimizer`), and the core asks a
backend what it can do through the capability flags below instead of reading the configuration.
The core never probes a backend with ``getattr``: every member below exists on every backend, which
the type checker verifies for each backend class (``mypy``, configured in ``pyproject.toml``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from smp2ds.engine.core.deepspeed_config import LossScaleArgs


@runtime_checkable
class Backend(Protocol):
    """How one SMP model runs on DeepSpeed under one parallelism."""

    name: str
    """Short name, used in messages and the start-up log."""

    # ---- capabilities: what the core asks instead of reading the configuration -------------------
    cast_io: bool
    """True when ``DistributedModel`` casts floating inputs to the 16-bit dtype (and outputs back)."""
    collective_state_dict: bool
    """True when ``state_dict()`` is a collective every rank must call (sharded parameters)."""
    can_rebuild_optimizer: bool
    """True when :meth:`rebuild` works (``add_param_group`` before the first step)."""
    forward_needs_step: bool
    """True when the model may only run inside an ``@smp.step`` function (pipeline stages)."""
    clips_in_step: bool
    """True when DeepSpeed clips inside the step at the configured value and ``clip_master_grads``
    does nothing (SMP's sharded data parallelism)."""

    @property
    def engine(self) -> Any:
        """The DeepSpeed engine (None before it is built)."""

    @property
    def ds_optimizer(self) -> Any:
        """DeepSpeed's optimizer object (None before the engine is built with an optimizer)."""

    # ---- construction and the step --------------------------------------------------------
    def build(self, optimizer: torch.optim.Optimizer | None = None,
              loss_scale: LossScaleArgs | None = None) -> None:
        """Create (or re-create, with the optimizer) the DeepSpeed engine."""

    def rebuild(self, optimizer: torch.optim.Optimizer, loss_scale: LossScaleArgs | None,
                regroup: Callable[[], None]) -> None:
        """Destroy the engine, let ``regroup()`` change the optimizer's groups, build it again
        (only where ``can_rebuild_optimizer``)."""

    def run_step(self, model: Any, step_fn: Any, args: tuple, kwargs: dict) -> list[Any]:
        """One ``@smp.step`` call: the step function's result per micro-batch."""

    def forward(self, *args: Any, **kwargs: Any) -> Any: ...
    def train(self, mode: bool) -> None: ...

    def step_backward(self, tensors: Any, grad_tensors: Any, microbatches: int, average: bool) -> None:
        """``model.backward(...)`` for one micro-batch."""

    def sync_gradients(self) -> None:
        """Reduce accumulated gradients once per optimizer step."""

    def optimizer_step(self) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    # ---- precision, clipping ----------------------------------------------------------------
    @property
    def precision(self) -> str: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def gradient_clipping(self) -> float:
        """The clipping value of DeepSpeed's configuration (0.0: none)."""

    @property
    def overflow(self) -> bool: ...
    @property
    def loss_scale(self) -> float: ...
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor: ...
    def clip_for_next_step(self, max_norm: float, norm: torch.Tensor) -> None: ...
    def refresh_master_params(self) -> None: ...

    # ---- state --------------------------------------------------------------------------------
    @property
    def partitioned(self) -> bool:
        """SMP's ``model.partitioned``: True once parameters are where they will train."""

    @property
    def optimizer_state_is_sharded(self) -> bool: ...
    def optimizer_state_dict(self) -> dict: ...
    def load_optimizer_state_dict(self, sd: dict) -> None: ...
    def optimizer_partition(self) -> tuple[int, int]: ...
    def full_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict: ...
    def local_state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict: ...
    def load_module_state_dict(self, sd: dict, strict: bool = True) -> Any: ...
    def local_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...
    def local_modules(self) -> Iterable[torch.nn.Module]: ...
    def param_shard_rank(self) -> int: ...
    def param_shard_size(self) -> int: ...
