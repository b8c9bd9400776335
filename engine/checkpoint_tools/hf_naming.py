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
from typing import Any

import torch

from smp2ds.engine.exceptions import SMPCheckpointError, SMPUnsupportedError

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
        meta = {k: torch.empty(shapes[k][0], dtype=shapes[k][1], device="meta") for k in unit}
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


def translate_optimizer(renaming: Renaming, optim: dict[str, Any]) -> dict[str, Any]:
    """``{"state", "param_groups"}`` by SMP name -> by Hugging Face name (moments translated, groups followed)."""
    group_of = {name: g for g, group in enumerate(optim["param_groups"]) for name in group["params"]}
    state: dict[str, dict[str, Any]] = {}
    members: list[list[str]] = [[] for _ in optim["param_groups"]]
    for index, unit in enumerate(renaming.units):
        owned = [k for k in unit if k in optim["state"]]
        if not owned:
            continue
        moments = [m for m, v in optim["state"][owned[0]].items() if isinstance(v, torch.Tensor) and v.dim()]
        scalars = {m: v for m, v in optim["state"][owned[0]].items() if m not in moments}
        translated = {m: renaming.translate_unit(index, {k: optim["state"][k][m] for k in owned}) for m in moments}
        groups = renaming.translate_unit(index, {k: _filled(optim["state"][k][moments[0]], group_of.get(k, 0))
                                                 for k in owned}) if moments else {}
        for key in (translated[moments[0]] if moments else {}):
            if key in renaming.aliases:
                continue
            found = torch.unique(groups[key]).tolist()
            if len(found) != 1:
                raise SMPUnsupportedError(
                    f"the Hugging Face parameter {key} joins parameters of optimizer parameter groups {found}; one "
                    "parameter has one group: export with --names smp to keep SMP's names")
            state[key] = {**{m: v.clone() if isinstance(v, torch.Tensor) else v for m, v in scalars.items()},
                          **{m: translated[m][key] for m in moments}}
            members[int(found[0])].append(key)
    groups_out = [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
                  for g, names in zip(optim["param_groups"], members)]
    return {"state": state, "param_groups": groups_out}


def _filled(like: torch.Tensor, value: int) -> torch.Tensor:
    """A tensor shaped as ``like`` holding ``value`` everywhere (uint8: one byte an element)."""
    return torch.full(like.shape, value, dtype=torch.uint8)
