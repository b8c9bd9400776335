"""Hugging Face transformer blocks, sharded Megatron-style by structure.

Each rule (declared by the family's module in ``smp2ds.engine.nn.huggingface``) names, for one block
class, the projections that become column-parallel (query, key,
value, the MLP's up/gate), the row-parallel ones (attention output, MLP down), fused projections
with their block count (GPT-2's ``c_attn`` holds q, k and v one after the other: 3 blocks;
GPT-NeoX's ``query_key_value`` is laid out per head: 1 block) and the head-count attributes the
attention module reads in ``forward``, divided by the degree. The block itself becomes a
tensor-parallel region (:mod:`region`). Embeddings, final norms and heads stay whole on every rank,
as SMP's distributed transformer kept them by default (``distribute_embedding: False``).

Blocks sharded in place always run the ``optimize: speed`` layout (hidden states whole on every rank);
with ``optimize: memory`` :func:`shard_model` warns once that the memory layout (sequence parallelism)
is SMP's distributed transformer's only (:mod:`smp2ds.engine.nn.sequence_parallel`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

from smp2ds.engine.exceptions import SMPUnsupportedError
from smp2ds.engine.nn.huggingface.families import BLOCK_RULES
from smp2ds.engine.nn.parallel.block_rule import BlockRule
from smp2ds.engine.nn.parallel.group import TPGroup
from smp2ds.engine.nn.parallel.layers import make_column_parallel, make_row_parallel
from smp2ds.engine.nn.parallel.region import make_region

RULES = BLOCK_RULES
"""Block class name -> rule, from the family modules (:mod:`smp2ds.engine.nn.huggingface.families`).
Cross-attention blocks are refused (see :func:`shard_block`)."""


def blocks(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, BlockRule]]:
    """Every transformer block of ``model`` a rule covers, with its name."""
    for name, module in model.named_modules():
        rule = RULES.get(type(module).__name__)
        if rule is not None:
            yield name, module, rule


def _counts(config: object) -> list[tuple[str, int]]:
    out = []
    for key in ("num_attention_heads", "n_head", "num_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            out.append((key, value))
    return out


def check_divisible(config: object, tp: int, where: str) -> None:
    """Refuse a model whose head counts the degree does not divide."""
    bad = [f"{k}={v}" for k, v in _counts(config) if v % tp]
    if bad:
        raise SMPUnsupportedError(f"{where}: tensor_parallel_degree {tp} must divide the attention head counts "
                                  f"({', '.join(bad)}); choose a degree that divides them")


def shard_block(block: torch.nn.Module, rule: BlockRule, tp: TPGroup, name: str) -> None:
    """Shard one block in place (names kept) and make it a tensor-parallel region."""
    if hasattr(block, "crossattention"):
        raise SMPUnsupportedError(f"{name}: tensor parallelism of cross-attention blocks is not implemented")
    for path in rule.column:
        make_column_parallel(block.get_submodule(path), tp, blocks=rule.fused.get(path, 1), path=f"{name}.{path}")
    for path in rule.row:
        make_row_parallel(block.get_submodule(path), tp, path=f"{name}.{path}")
    for dotted in rule.heads:
        owner_path, _, attr = dotted.rpartition(".")
        owner = block.get_submodule(owner_path)
        value = getattr(owner, attr, None)
        if isinstance(value, int):
            setattr(owner, attr, value // tp.size)
    make_region(block, tp)


def shard_model(model: torch.nn.Module, tp: TPGroup,
                around: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None) -> list[str]:
    """Shard every covered block of a Hugging Face model; returns their names (empty: none found).

    ``around(block)`` (optional) wraps each block's sharding (``registry.apply``'s argument)."""
    found = list(blocks(model))
    if not found:
        return []
    config = getattr(model, "config", None)
    if config is not None:
        check_divisible(config, tp.size, type(model).__name__)
    classes = sorted({type(block).__name__ for _, block, _ in found})
    for name, block, rule in found:
        with around(block) if around is not None else contextlib.nullcontext():
            shard_block(block, rule, tp, name)
    if tp.optimize == "memory":
        _warn_speed_layout(type(model).__name__, classes)
    return [name for name, _, _ in found]


_WARNED: list[bool] = []


def _warn_speed_layout(model: str, classes: list[str]) -> None:
    """Once per process: blocks sharded in place ignore ``optimize: memory``."""
    if _WARNED:
        return
    _WARNED.append(True)
    warnings.warn(f"optimize: memory applies to SMP's distributed transformer (smp.nn.DistributedTransformer*) "
                  f"only: {model}'s {', '.join(classes)} blocks, sharded in place under their Hugging Face names, "
                  "run the speed layout (hidden states whole on every tensor-parallel rank, activations "
                  "duplicated); build the model inside smp.model_creation(tensor_parallelism=True) with SMP's "
                  "transformer settings to have GPT-2, GPT-J, GPT-NeoX and BERT replaced by it", stacklevel=2)
