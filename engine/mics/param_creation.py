"""Parameters born partitioned over the MiCS shard group, with the values the model's own init gives.

``mics_init_context`` wraps DeepSpeed's ``zero.Init`` for ``delayed_parameter_initialization`` and
``smp.model_creation(zero_init=True)``. What goes wrong with a bare ``zero.Init`` is repaired here:

* **Lazy imports.** ``zero.Init`` replaces ``torch.Tensor.__new__`` with a Python function while
  it is active. ``torch._dynamo`` checks the signature of ``Tensor.__new__`` when it is first
  imported and raises ``TypeError: Signature mismatch ... tensor_pynew``; Hugging Face imports
  model code (and through it ``torch._dynamo``) lazily, on first attribute access, so building
  ``transformers.GPT2LMHeadModel`` inside the context failed. Such modules are imported before
  ``zero.Init`` patches anything.
* **Hugging Face weight init.** ``zero.Init`` partitions each module's parameters when its own
  ``__init__`` returns, so by the time a ``PreTrainedModel`` runs ``post_init`` (its
  ``_init_weights`` over all submodules) the tensors are empty and the init is lost (GPT-2's
  ``wte`` kept ``nn.Embedding``'s N(0, 1) instead of N(0, 0.02)). While the context is active,
  ``PreTrainedModel._initialize_weights`` runs on gathered parameters (the module's own and its
  direct children's, which is what ``_init_weights`` may touch) and the shard group's first
  rank's result is re-partitioned. The init functions run in the model's own order on full
  tensors, so a seeded model gets exactly the weights an eagerly built one gets.
  (``Module.apply``-based inits are gathered by DeepSpeed itself.)
* **Hugging Face loading.** ``from_pretrained`` builds on the meta device and copies whole tensors
  unless transformers believes ZeRO-3 is on; while the context lasts it is told so (and that
  ``zero.Init`` is already active), and loads the checkpoint through gathered parameters.
* **Group-local broadcast source** for DeepSpeed's ``Module.apply`` wrapper (see below).

The Hugging Face repairs are installed on entry when transformers is loaded, or else as soon as it
is first imported inside the block (a builder function importing it itself).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.mics.mpu import ShardGroupMPU
from smp2ds.engine.mics.shard_groups import MicsGroups
from smp2ds.engine.mics.zero3 import shard_ds_config

_IMPORT_BEFORE_PATCHING = ("torch._dynamo",)
"""Modules that read ``torch.Tensor.__new__`` (or other callables ``zero.Init`` replaces) at import."""


@contextlib.contextmanager
def mics_init_context(ds_config: Mapping[str, Any], groups: MicsGroups, enabled: bool = True) -> Iterator[None]:
    """Create parameters already partitioned over the shard group.

    Wraps ``deepspeed.zero.Init(data_parallel_group=shard_group, config_dict_or_path=...)``; use it
    around model construction (``smp.delay_param_initialization()`` / ``smp.model_creation()``).
    Parameters are created in the training precision of ``ds_config`` (DeepSpeed's rule).
    Replicas are made identical later, in ``initialize``.
    """
    import deepspeed

    cfg = shard_ds_config(ds_config, groups)
    if enabled:
        import_lazy_modules()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_group_local_broadcast_src())
        if enabled:
            def repair_hf(_: Any = None) -> None:
                stack.enter_context(_hf_init_on_gathered_parameters())
                stack.enter_context(_hf_sees_zero3(cfg))

            if "transformers.modeling_utils" in sys.modules:
                repair_hf()
            else:  # transformers imported inside the block: repair it as soon as it is loaded
                stack.enter_context(_after_import("transformers.modeling_utils", repair_hf))
        stack.enter_context(deepspeed.zero.Init(data_parallel_group=groups.shard_group, config_dict_or_path=cfg,
                                                mpu=ShardGroupMPU(groups), enabled=enabled))
        yield


def import_lazy_modules() -> None:
    """Import now what would otherwise be imported lazily, and fail, inside ``zero.Init``.

    ``torch._dynamo`` always; with transformers loaded, its ``modeling_utils`` too (it pulls in
    ``torch._dynamo`` and must be loaded for the init hook to be installed).
    """
    for name in _IMPORT_BEFORE_PATCHING:
        importlib.import_module(name)
    if "transformers" in sys.modules:
        importlib.import_module("transformers.modeling_utils")


class _CallAfterExec(importlib.abc.Loader):
    """A loader that runs the real one, then ``then(module)``."""

    def __init__(self, loader: Any, then: Callable[[Any], None]):
        self.loader, self.then = loader, then

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.then(module)


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds ``name`` through the other finders and arranges for ``then(module)`` after it loads."""

    def __init__(self, name: str, then: Callable[[Any], None]):
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _CallAfterExec(spec.loader, self.then)
                return spec
        return None


@contextlib.contextmanager
def _after_import(name: str, then: Callable[[Any], None]) -> Iterator[None]:
    """While active, run ``then(module)`` right after module ``name`` is first imported."""
    watcher = _ImportWatcher(name, then)
    sys.meta_path.insert(0, watcher)
    try:
        yield
    finally:
        sys.meta_path.remove(watcher)


def _params_init_may_touch(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The partitioned parameters an ``_init_weights(module)`` call may write: the module's own and
    its direct children's (Hugging Face's rule too, e.g. GPT-2 re-initialises ``c_proj.weight``
    from the attention block)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list(module.parameters(recurse=False))
    for child in module.children():
        params.extend(child.parameters(recurse=False))
    seen: set[int] = set()
    gathered = []
    for p in params:
        # Parameters already available (gathered by an enclosing Module.apply wrapper) stay as they are.
        if id(p) in seen or getattr(p, "ds_status", None) != ZeroParamStatus.NOT_AVAILABLE:
            continue
        seen.add(id(p))
        gathered.append(p)
    return gathered


def _gathering(initialize: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``PreTrainedModel._initialize_weights`` so it runs on full (gathered) parameters."""

    @functools.wraps(initialize)
    def initialize_gathered(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(module, "_is_hf_initialized", False):
            return initialize(self, module, *args, **kwargs)
        params = _params_init_may_touch(module)
        if not params:
            return initialize(self, module, *args, **kwargs)
        import deepspeed

        # Every rank runs the init (same RNG consumption as an eager build); the shard group's
        # first rank's values are written back to every partition.
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            return initialize(self, module, *args, **kwargs)

    initialize_gathered.smp2ds_gathering = True  # type: ignore[attr-defined]
    return initialize_gathered


@contextlib.contextmanager
def _hf_init_on_gathered_parameters() -> Iterator[None]:
    """Make Hugging Face's weight init see full tensors while the context is active."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    model_cls = getattr(modeling_utils, "PreTrainedModel", None)
    original = getattr(model_cls, "_initialize_weights", None)
    if original is None or getattr(original, "smp2ds_gathering", False):
        yield
        return
    model_cls._initialize_weights = _gathering(original)
    try:
        yield
    finally:
        model_cls._initialize_weights = original


class _Zero3Config:
    """What transformers asks of its ``HfDeepSpeedConfig`` (``is_zero3()``, ``config``)."""

    def __init__(self, config: Mapping[str, Any]):
        self.config = dict(config)

    def is_zero3(self) -> bool:
        return True


@contextlib.contextmanager
def _hf_sees_zero3(ds_config: Mapping[str, Any]) -> Iterator[None]:
    """Tell transformers that ZeRO-3 is on and ``zero.Init`` already active while the context lasts.

    ``from_pretrained`` then builds the model in our context (not on the meta device, not under a
    second ``zero.Init`` over the whole world) and loads the checkpoint through gathered
    parameters (``_load_state_dict_into_zero3_model``). It loads on global rank 0 only: shard groups
    without it get the loaded values from the first shard group when the engine is built
    (``zero3.sync_replicas``).
    """
    hf_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if hf_deepspeed is None or modeling_utils is None or not hasattr(hf_deepspeed, "set_hf_deepspeed_config"):
        yield
        return
    previous = getattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    view = _Zero3Config(ds_config)  # referenced here: transformers keeps only a weak reference
    hf_deepspeed.set_hf_deepspeed_config(view)
    zero3_state = getattr(modeling_utils, "set_zero3_state", contextlib.nullcontext)
    try:
        with zero3_state():
            yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = previous
        del view


@contextlib.contextmanager
def _group_local_broadcast_src() -> Iterator[None]:
    """Make DeepSpeed's ``module.apply`` re-broadcast work for shard groups without global rank 0.

    Under ``zero.Init`` DeepSpeed wraps ``Module.apply`` and re-broadcasts each parameter with
    ``dist.broadcast(t, 0, group=param.ds_process_group)`` (partition_parameters.py, 0.19.8): src 0
    is a *global* rank, which is not in shard groups 1..R-1. While the context is active, a src
    that is not in the group is read as "the group's first rank", which is what DeepSpeed means.
    """
    from deepspeed.runtime.zero import partition_parameters as pp

    ds_dist = pp.dist
    original = ds_dist.broadcast

    def broadcast(tensor: torch.Tensor, src: int, group: Any = None, *args: Any, **kwargs: Any) -> Any:
        if group is not None:
            ranks = comm.get_process_group_ranks(group)
            if src not in ranks:
                src = ranks[0]
        return original(tensor, src, group, *args, **kwargs)

    ds_dist.broadcast = broadcast
    try:
        yield
    finally:
        ds_dist.broadcast = original
