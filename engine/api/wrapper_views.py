"""The wrappers SMP put between ``smp.DistributedModel`` and the user's module, as scripts walk them.

SMP's ``DistributedModel.module`` was not the user's module. With ``ddp`` (and without sharded data
parallelism) it was SMP's data-parallel wrapper, a subclass of torch's ``DistributedDataParallel``; with
``fp16`` or ``bf16`` there was a 16-bit wrapper inside it. Public scripts reach their model through that chain:
``model.module.module.transformer.seq_layers`` (the tensor-parallel GPT-J and ViT examples, ddp in fp32),
``model.module.module.module.transformer.seq_layers`` (with a 16-bit wrapper), or a loop that unwraps while
``isinstance(m, (DistributedDataParallel, FP16_Module))``.

Here the chain is a view: the wrappers hold the user's module and call it, and nothing else. DeepSpeed
reduces the gradients; the wrappers are not registered in the ``DistributedModel``, so parameter names,
``state_dict`` keys and ``modules()`` are the user's module's, as in SMP. A name a wrapper does not have is
read from the module it wraps (``model.module.config`` keeps working), which SMP's wrappers did not do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel


class _Forwarding:
    """Mixin: call the wrapped module, and read names the wrapper lacks from it."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._modules["module"](*args, **kwargs)  # type: ignore[attr-defined]

    @property
    def training(self) -> bool:
        """The wrapped module's mode: ``model.eval()`` reaches the model, not this unregistered wrapper."""
        modules = self.__dict__.get("_modules")
        return bool(modules["module"].training) if modules and "module" in modules else True

    @training.setter
    def training(self, mode: bool) -> None:
        """``train(mode)`` sets the wrapped module's mode (through its children); nothing to keep here."""

    def __getattr__(self, name: str) -> Any:
        try:
            return torch.nn.Module.__getattr__(self, name)  # type: ignore[arg-type]
        except AttributeError:
            modules = self.__dict__.get("_modules")
            if name.startswith("__") or not modules or "module" not in modules:
                raise
            return getattr(modules["module"], name)


class DataParallelWrapper(_Forwarding, DistributedDataParallel):
    """``model.module`` under ``ddp``: an instance of torch's ``DistributedDataParallel`` (as SMP's was), so
    scripts' ``isinstance`` unwrapping loops pass through it. It never runs DDP's reducer: torch's
    ``DistributedDataParallel.__init__`` is not called, and gradients are DeepSpeed's to reduce."""

    def __init__(self, module: torch.nn.Module):
        torch.nn.Module.__init__(self)
        self.module = module

    def __getstate__(self) -> dict[str, Any]:
        """A plain module's state: DDP's own ``__getstate__`` reads the process group this wrapper never had
        (``copy.deepcopy`` of the model, or of ``model.module``, goes through here)."""
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        torch.nn.Module.__setstate__(self, state)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients are reduced by the engine at the optimizer step (``backward_passes_per_step``), so there
        is nothing to hold back here."""
        yield


class Bit16Wrapper(_Forwarding, torch.nn.Module):
    """``model.module`` (or ``model.module.module`` under ``ddp``) with ``fp16`` or ``bf16``: SMP's 16-bit
    wrapper. The casts it stood for are DeepSpeed's here; this level only keeps the scripts' paths."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def wrapper_chain(module: torch.nn.Module, *, data_parallel: bool, sixteen_bit: bool) -> torch.nn.Module:
    """What ``DistributedModel.module`` is: ``module`` inside a 16-bit wrapper when ``sixteen_bit``, that
    inside a data-parallel wrapper when ``data_parallel``; ``module`` itself when neither."""
    if sixteen_bit:
        module = Bit16Wrapper(module)
    if data_parallel:
        module = DataParallelWrapper(module)
    return module
