"""SMP distributed-transformer names -> Hugging Face's, for exports that stream (DCP, DeepSpeed universal).

A checkpoint written with SMP's distributed transformer holds ``transformer.seq_layers.<i>.attention.query.weight``,
``word_embedding.weight`` ...: a Hugging Face model under FSDP2 or DeepSpeed loads none of them. The family's offline
translator (``smp.nn.huggingface.<family>.export_to_hf``, the same one ``export --to hf`` uses) renames, splits,
joins and transposes. Every such operation is a rearrangement of elements, so Adam's moments (elementwise per
parameter) translate exactly like the weights they belong to.

The translation runs one *unit* at a time: each ``seq_layers.<i>`` layer, then the tensors outside the layers
(embeddings, final norm, head), so an export holds one layer's tensors at once, not the model. Shapes and dtypes
of the output come from translating meta tensors first (nothing is read). Which optimizer parameter group a
translated parameter belongs to is found the same way, by translating each source's group index: a translated
parameter whose sources sit in two groups is refused by name. A tied output head the translator adds (the
embedding again) is a second name of one parameter: it gets the weights but no optimizer state of its own.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from smp2ds.engine.exceptions import SMPCheckpointError, SMPUnsupportedError

if TYPE_CHECKING:  # the annotation only: optimizer_state is the reading side, this module the naming side
    from smp2ds.engine.checkpoint_tools.optimizer_state import StateSource

_LAYER = re.compile(r"^(.*?\.seq_layers\.\d+\.)")
Translate = Callable[[dict[str, Any]], dict[str, Any]]


def has_smp_names(keys: Any) -> bool:
    """Whether a state dict's ``keys`` are SMP distributed-transformer names."""
    return any(".seq_layers." in k for k in keys)


def units(keys: list[str]) -> list[list[str]]:
    """The keys grouped for translation: each ``seq_layers.<i>`` layer, then everything else, in first-seen order."""
    layers: dict[str, list[str]] = {}
    rest: list[str] = []
    for key in keys:
        found = _LAYER.match(key)
        if found:
            layers.setdefault(found.group(1), []).append(key)
        else:
            rest.append(key)
    return [*layers.values(), *([rest] if rest else [])]


@dataclass
class Renaming:
    """How one checkpoint's tensors become Hugging Face's: units of SMP keys and what each produces."""

    translate: Translate
    units: list[list[str]]
    outputs: list[tuple[str, tuple[int, ...], torch.dtype, int]] = field(default_factory=list)
    """``(Hugging Face key, shape, dtype, unit index)`` of every translated tensor, unit by unit."""
    aliases: set[str] = field(default_factory=set)
    """Hugging Face keys that are another key's tensor again (a tied head): weights only, no optimizer state."""

    def translate_unit(self, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Unit ``index``'s Hugging Face tensors from its SMP ``tensors`` (one per key of the unit)."""
        try:
            return self.translate(tensors)
        except KeyError as exc:
            raise SMPCheckpointError(f"translating {sorted(tensors)[:3]}... to Hugging Face names: {exc}") from None


def plan(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], translate: Translate) -> Renaming:
    """The renaming of a checkpoint whose full tensors have ``shapes`` (SMP key -> (shape, dtype))."""
    renaming = Renaming(translate, units(list(shapes)))
    for index, unit in enumerate(renaming.units):
        meta = {k: meta_tensor(*shapes[k]) for k in unit}
        out = renaming.translate_unit(index, meta)
        seen: dict[int, str] = {}
        for key, tensor in out.items():
            if id(tensor) in seen:
                renaming.aliases.add(key)
            seen.setdefault(id(tensor), key)
            renaming.outputs.append((key, tuple(tensor.shape), tensor.dtype, index))
    return renaming


def iter_translated(renaming: Renaming, load: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face key, tensor)`` unit by unit; ``load(smp_key)`` gives a full SMP tensor."""
    for index, unit in enumerate(renaming.units):
        out = renaming.translate_unit(index, {k: load(k) for k in unit})
        yield from out.items()
        del out


@dataclass
class TranslatedState:
    """The optimizer state's plan under Hugging Face's names: what :func:`unit_moments` will produce."""

    state: dict[str, dict[str, Any]]
    """Hugging Face key -> its scalars (Adam's step) and each moment as a meta tensor (shape and dtype)."""
    param_groups: list[dict[str, Any]]
    """The source's groups, ``params`` by Hugging Face name."""
    unit_of: dict[str, int]
    """Hugging Face key -> the unit that produces its moments."""


def plan_state(renaming: Renaming, source: StateSource) -> TranslatedState:
    """Which Hugging Face parameters get which state, found without reading a moment.

    Shapes come from translating meta tensors; the group of each translated parameter from translating each
    source's group index (only when there is more than one group). A parameter joined from two groups is refused.
    """
    group_of = {name: g for g, group in enumerate(source.param_groups) for name in group["params"]}
    state: dict[str, dict[str, Any]] = {}
    unit_of: dict[str, int] = {}
    members: list[list[str]] = [[] for _ in source.param_groups]
    for index, unit in enumerate(renaming.units):
        owned = [k for k in unit if source.moments.get(k)]
        if not owned:
            continue
        keys = list(source.moments[owned[0]])
        meta = {m: renaming.translate_unit(index, {k: meta_tensor(*source.moments[k][m]) for k in owned})
                for m in keys}
        groups = (renaming.translate_unit(index, {k: _filled(source.moments[k][keys[0]][0], group_of.get(k, 0))
                                                  for k in owned}) if len(source.param_groups) > 1 else None)
        for key in meta[keys[0]]:
            if key in renaming.aliases:
                continue
            found = (torch.bincount(groups[key].flatten(), minlength=len(source.param_groups)).nonzero().flatten()
                     .tolist() if groups is not None else [group_of.get(owned[0], 0)])  # bincount: no sorted copy
            if len(found) != 1:
                raise SMPUnsupportedError(
                    f"the Hugging Face parameter {key} joins parameters of optimizer parameter groups {found}; one "
                    "parameter has one group: export with --names smp to keep SMP's names")
            scalars = source.scalars[owned[0]]
            state[key] = {**{m: v.clone() if isinstance(v, torch.Tensor) else v for m, v in scalars.items()},
                          **{m: meta[m][key] for m in keys}}
            unit_of[key] = index
            members[int(found[0])].append(key)
    groups_out = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
                  for g, names in zip(source.param_groups, members)]
    return TranslatedState(state, groups_out, unit_of)


def unit_moments(renaming: Renaming, index: int, source: StateSource, moment: str) -> dict[str, torch.Tensor]:
    """One moment of unit ``index``'s parameters under Hugging Face's names (a tied head's second name left out)."""
    owned = [k for k in renaming.units[index] if source.moments.get(k)]
    out = renaming.translate_unit(index, {k: source.tensor(k, moment) for k in owned}) if owned else {}
    return {k: v for k, v in out.items() if k not in renaming.aliases}


def meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor with ``shape`` and ``dtype`` and no storage (what a plan or DCP needs of it)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _filled(shape: tuple[int, ...], value: int) -> torch.Tensor:
    """A tensor of ``shape`` holding ``value`` everywhere (uint8: one byte an element)."""
    return torch.full(shape, value, dtype=torch.uint8)
