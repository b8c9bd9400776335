"""State dicts of a model whose Hugging Face part SMP's distributed transformer replaced, between the two
naming schemes: SMP's ``(smp_to_hf, hf_to_smp)`` translate functions.

SMP registered such a pair in ``smp.state.module_manager.translate_functions`` for every replacement. Three
readers use it, as in SMP:

* ``smp.save_checkpoint(..., partial=False)`` (``translate_if_full``, the default) writes Hugging Face's names;
* transformers' ``save_pretrained`` applies each ``smp_to_hf`` to the state dict it saves;
* ``DistributedModel.load_state_dict`` of a plain Hugging Face-named dict (a pretrained ``state_dict()``,
  ``fullmodel.pt``) applies each ``hf_to_smp`` first.

The replaced module may sit anywhere in the wrapped model (BERT's encoder at ``bert.encoder``): only the keys under
its ``prefix`` are renamed. Each direction leaves a dict already in its target names unchanged (told by the
replacement's own parameter names), so applying it twice, or to a dict a script translated itself, is harmless.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Translate = Callable[[dict[str, Any]], dict[str, Any]]

SHARED_NAMES = frozenset({"lm_head.weight", "lm_head.bias"})
"""Names both schemes use: they tell neither apart."""


@dataclass(frozen=True)
class NameTranslation:
    """How one replaced module's state dict names map to Hugging Face's and back."""

    prefix: str
    """Where the replacement sits in the wrapped model's state dict (``""``: it is the model)."""
    smp_names: frozenset[str]
    """The replacement's own state-dict names (relative to ``prefix``)."""
    to_hf: Translate
    """The replacement's state dict (SMP's names, relative) -> Hugging Face's names."""
    to_smp: Translate
    """A Hugging Face state dict (relative) -> the replacement's names, fitted to it (tied head)."""

    def _split(self, state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        inner, outer = {}, {}
        for key, value in state_dict.items():
            if key.startswith(self.prefix):
                inner[key[len(self.prefix):]] = value
            else:
                outer[key] = value
        return inner, outer

    def _has_smp_names(self, inner: Mapping[str, Any]) -> bool:
        return any(key in self.smp_names for key in inner if key not in SHARED_NAMES)

    def _join(self, outer: dict[str, Any], inner: dict[str, Any]) -> dict[str, Any]:
        return {**outer, **{f"{self.prefix}{key}": value for key, value in inner.items()}}

    def smp_to_hf(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the replacement's part in Hugging Face's names."""
        inner, outer = self._split(state_dict)
        if not self._has_smp_names(inner):
            return dict(state_dict)
        return self._join(outer, self.to_hf(inner))

    def hf_to_smp(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the replacement's part in SMP's names."""
        inner, outer = self._split(state_dict)
        if not inner or self._has_smp_names(inner):
            return dict(state_dict)
        return self._join(outer, self.to_smp(inner))
