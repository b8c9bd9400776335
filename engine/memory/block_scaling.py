"""A deep model's step traced on a few of its blocks and scaled to all of them.

The blocks of one transformer are alike: each holds the same parameters, saves the same activations for backward
and makes the same transient tensors. So every figure the tracer reports for a stretch of ``n`` blocks (with the
layers before and after them) is ``a + b * n``: the parameters and the activations saved until backward grow by
one block's worth per block, and the step's peak, at the turn from forward to backward or inside the first backward
block, sits on top of all of them. Two traces of neighbouring block counts give ``a`` and ``b``, and the figure of
any count follows exactly. Tracing the 80 blocks of a 70B model on fake tensors takes 8 to 30 seconds per layout on
2 CPU cores; one and two blocks take about one (``bench/fit_search.py``), which is what lets ``--fit`` search a
cluster's layouts. Scaled and whole traces are compared
in ``tests/engine/memory/test_memory_block_scaling.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from smp2ds.engine.memory.step_trace import StepTrace

SCALE_ABOVE = 4
"""Models with more blocks than this are traced on 1 and 2 blocks and scaled; smaller ones are traced whole."""
LOW, HIGH = 1, 2
"""The block counts traced: neighbours, so the scaling is integer arithmetic; every figure is already on its line
from the first block (equal to whole traces for GPT-2, LLaMA and BERT, with and without checkpointing)."""
_NUMBERED = re.compile(r"^(?P<stack>.+)\.(?P<index>\d+)$")


def scale_trace(low: StepTrace, high: StepTrace, n: int) -> StepTrace:
    """The trace of ``n`` blocks from those of ``LOW`` and ``HIGH`` blocks."""
    return StepTrace(**{f.name: scale_count(getattr(low, f.name), getattr(high, f.name), n)
                        for f in fields(StepTrace)})


def scale_count(low: int, high: int, n: int) -> int:
    """A count that grows by ``high - low`` per block, at ``n`` blocks."""
    return low + (high - low) * (n - LOW)


@dataclass(frozen=True)
class BlockSpan:
    """Where a layer list's blocks are: ``head`` layers before them, ``count`` blocks, ``tail`` layers after."""

    head: int
    count: int
    tail: int


def block_span(names: list[str]) -> BlockSpan | None:
    """The one run of numbered blocks (``model.layers.0`` ... ``model.layers.N``) in a pipeline layer list's
    names; None when the list has two stacks (an encoder and a decoder) or none."""
    stacks = [match.group("stack") if (match := _NUMBERED.match(name)) else None for name in names]
    found = {stack for stack in stacks if stack is not None}
    if len(found) != 1:
        return None
    positions = [i for i, stack in enumerate(stacks) if stack is not None]
    first, last = positions[0], positions[-1]
    if last - first + 1 != len(positions):
        return None
    return BlockSpan(head=first, count=len(positions), tail=len(names) - last - 1)


@dataclass(frozen=True)
class Segment:
    """The layers of a small model (``start`` to ``stop``) that stand for one stage of the whole one, and how many
    blocks they hold (``blocks``) in place of the stage's ``stage_blocks``."""

    start: int
    stop: int
    blocks: int
    stage_blocks: int


def stage_segment(start: int, stop: int, whole: BlockSpan, small: BlockSpan, blocks: int) -> Segment | None:
    """The small model's layers for the whole model's stage ``[start, stop)`` with ``blocks`` of its blocks (the
    stage's own head and tail layers kept); None when the stage holds the first and the last layer but not every
    block in between (no stage of a pipeline does)."""
    block_start, block_stop = whole.head, whole.head + whole.count
    head = (start, min(stop, block_start)) if start < block_start else None
    tail_first = max(start, block_stop)
    tail = (tail_first - block_stop, stop - block_stop) if stop > block_stop else None
    stage_blocks = max(0, min(stop, block_stop) - max(start, block_start))
    if head and tail and stage_blocks != whole.count:
        return None
    small_stop_of_blocks = small.head + small.count
    if tail:
        first_block = small_stop_of_blocks - blocks
    else:
        first_block = small.head
    seg_start = head[0] if head else (first_block if blocks else small_stop_of_blocks + (tail[0] if tail else 0))
    if tail:
        seg_stop = small_stop_of_blocks + tail[1]
    elif blocks:
        seg_stop = first_block + blocks
    else:
        seg_stop = head[1] if head else seg_start
    return Segment(start=seg_start, stop=seg_stop, blocks=blocks, stage_blocks=stage_blocks)


def counts_for(stage_blocks: int) -> tuple[int, ...]:
    """The block counts to trace for a stage of ``stage_blocks``: itself when a small model holds it, else the two
    the scaling uses."""
    return (stage_blocks,) if stage_blocks <= HIGH else (LOW, HIGH)


