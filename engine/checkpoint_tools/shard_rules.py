"""How each tensor of a partial model file sits in its full tensor, without building the model.

A partial file stores each rank's pieces under the full model's names but not how they were cut
(SMP never recorded it). The cut is known from the name for every layer smp2ds shards:

* Hugging Face blocks sharded in place (:data:`smp2ds.engine.nn.huggingface.families.BLOCK_RULES`):
  column projections split their output features (``nn.Linear`` weight dim 0, GPT-2 ``Conv1D``
  dim 1; bias dim 0; GPT-2's fused ``c_attn`` in 3 blocks), row projections their input
  features (weight dim 1, ``Conv1D`` dim 0; bias whole);
* SMP's distributed transformer (``smp.nn.DistributedTransformer*``): query/key/value and
  ``output.dense1`` column, ``attention.dense`` and ``output.dense2`` row.

Every other tensor is whole on every rank unless ``distribute_embedding=True`` split the
vocabulary (``word_embedding.weight``, ``lm_head.weight``, ``lm_head_bias``: rows). Those two
cases differ in content, not in name, so for them the pieces decide: identical on every rank
means whole; different pieces of a vocabulary tensor are rows; different pieces of any other
tensor (a user's own ``smp.nn.DistributedLinear``) are refused by name, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from smp2ds.engine.nn.huggingface.families import BLOCK_RULES as RULES

_DISTRIBUTED_TRANSFORMER = ("smp_distributed_transformer",
                            ("attention.query", "attention.key", "attention.value", "output.dense1"),
                            ("attention.dense", "output.dense2"), {}, False)
VOCAB_SUFFIXES = ("word_embedding.weight", "lm_head.weight", "lm_head_bias")


@dataclass(frozen=True)
class Split:
    """The full tensor's dimension ``dim`` read as ``blocks`` equal blocks, each cut in tp pieces
    (the layout of :class:`smp2ds.engine.nn.parallel.shards.ShardSpec`)."""

    dim: int
    blocks: int = 1


def _rules() -> list[tuple[str, tuple[str, ...], tuple[str, ...], dict[str, int], bool]]:
    seen, out = set(), []
    for rule in RULES.values():
        key = (rule.family, rule.column, rule.row)
        if key not in seen:
            seen.add(key)
            out.append((rule.family, rule.column, rule.row, dict(rule.fused), rule.conv1d))
    out.append(_DISTRIBUTED_TRANSFORMER)
    return out


def name_splits(keys: list[str] | set[str]) -> dict[str, Split | None]:
    """For every key inside a transformer block a rule covers: its :class:`Split`, or None (whole).

    A block is recognised when all of a rule's projections are present under one prefix, so
    GPT-2's ``mlp.c_proj`` (a ``Conv1D``) is never taken for GPT-Neo's (an ``nn.Linear``).
    """
    present = set(keys)
    out: dict[str, Split | None] = {}
    for _family, column, row, fused, conv in _rules():
        anchor = f".{column[0]}.weight"
        prefixes = {k[: -len(anchor) + 1] for k in present if k.endswith(anchor)}
        for prefix in sorted(prefixes):
            if not all(f"{prefix}{p}.weight" in present for p in column + row):
                continue
            for path in column:
                blocks = fused.get(path, 1)
                out[f"{prefix}{path}.weight"] = Split(1 if conv else 0, blocks)
                out[f"{prefix}{path}.bias"] = Split(0, blocks)
            for path in row:
                out[f"{prefix}{path}.weight"] = Split(0 if conv else 1)
                out[f"{prefix}{path}.bias"] = None
    return {k: v for k, v in out.items() if k in present}


def is_vocabulary(key: str) -> bool:
    """A tensor ``distribute_embedding=True`` splits by rows (vocabulary)."""
    return key.endswith(VOCAB_SUFFIXES)
