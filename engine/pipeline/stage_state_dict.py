"""State dicts of a stage-partitioned model under the original model's key names.

Pipeline layers wrap the user's own modules, so every parameter and buffer a stage holds is
found in the original model. Names are resolved through the owning *module* object and the
attribute name (module objects survive ``.to(device)``, buffer tensors may not), falling back
to parameter identity for parameters our wrappers re-register (e.g. BERT's decoder bias). A tied
weight has every key the original ``state_dict`` lists for it (``transformer.wte.weight`` and
``lm_head.weight``) and lives on each stage that uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

TensorMap = Callable[[torch.Tensor], torch.Tensor]
"""A stage tensor -> the tensor a full state dict holds for it (e.g. tensor-parallel shards joined)."""
CutMap = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(stage tensor, loaded value) -> the part of the value this rank holds."""


class StateNames:
    """Maps the tensors of a pipeline stage to the original model's ``state_dict`` keys."""

    def __init__(self, model: nn.Module, extra_slots: tuple[tuple[nn.Module, str, str], ...] = ()):
        keys = set(model.state_dict(keep_vars=True).keys())
        self.all_keys: frozenset[str] = frozenset(keys)
        self._by_slot: dict[tuple[int, str], list[str]] = {}
        self._by_param: dict[int, list[str]] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            prefix = f"{path}." if path else ""
            for attr, tensor in list(module._parameters.items()) + list(module._buffers.items()):
                key = prefix + attr
                if tensor is None or key not in keys:
                    continue
                self._by_slot.setdefault((id(module), attr), []).append(key)
                if isinstance(tensor, nn.Parameter):
                    self._by_param.setdefault(id(tensor), []).append(key)
        # Buffers a pipeline layer holds outside their own module (a traced layer's direct reads).
        for holder, attr, key in extra_slots:
            if key in keys:
                self._by_slot.setdefault((id(holder), attr), []).append(key)
        # Keep the modules alive: ids are only meaningful while the objects exist.
        self._modules = list(model.modules()) + [holder for holder, _, _ in extra_slots]

    def local_tensors(self, stage_module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``(original key, tensor)`` for every parameter/persistent buffer of ``stage_module``."""
        seen: set[str] = set()
        for module in stage_module.modules():
            for attr, tensor in list(module._parameters.items()) + list(module._buffers.items()):
                if tensor is None:
                    continue
                # Parameters keep their identity, and a tied one carries all its keys that way;
                # buffers may be replaced by .to(), so they are found through their module.
                keys = self._by_param.get(id(tensor)) if isinstance(tensor, nn.Parameter) else None
                if keys is None:
                    keys = self._by_slot.get((id(module), attr))
                for key in keys or ():
                    if key not in seen:
                        seen.add(key)
                        yield key, tensor


def local_state_dict(names: StateNames, stage_module: nn.Module,
                     full: TensorMap | None = None) -> dict[str, torch.Tensor]:
    """This stage's tensors under their original keys (detached CPU copies); ``full`` maps each
    tensor first (collective when it joins tensor-parallel shards: every rank calls it in the
    same order)."""
    out = {}
    for key, t in names.local_tensors(stage_module):
        out[key] = (full(t) if full is not None else t).detach().cpu().clone()
    return out


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Union of per-stage dicts; a tied key present on several stages keeps the first copy."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            out.setdefault(key, value)
    return out


@torch.no_grad()
def load_local(names: StateNames, stage_module: nn.Module, state: dict[str, Any], strict: bool = True,
               cut: CutMap | None = None) -> list[str]:
    """Copy the entries of ``state`` this stage holds into its tensors; return the keys loaded.

    ``strict``: every key this stage holds must be present, and no key may be unknown to the
    original model (keys of other stages are fine: they are loaded there). ``cut`` picks this
    rank's part of a loaded value (a full tensor for a tensor-parallel shard).
    """
    local = dict(names.local_tensors(stage_module))
    if strict:
        missing = sorted(k for k in local if k not in state)
        unknown = sorted(k for k in state if k not in names.all_keys and not k.startswith("_smp"))
        if missing or unknown:
            raise KeyError(f"state dict does not fit the pipelined model: missing {missing[:8]}"
                           f"{' ...' if len(missing) > 8 else ''}, unexpected {unknown[:8]}"
                           f"{' ...' if len(unknown) > 8 else ''}")
    loaded = []
    for key, tensor in local.items():
        if key in state:
            value = torch.as_tensor(state[key])
            if cut is not None:
                value = cut(tensor, value)
            tensor.copy_(value.to(device=tensor.device, dtype=tensor.dtype))
            loaded.append(key)
    return loaded
