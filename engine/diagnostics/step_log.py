"""Rank-tagged progress lines, when asked for with ``SMP2DS_LOG``.

SMP printed its configuration and per-step information to the job log; smp2ds stays quiet unless
``SMP2DS_LOG`` names a level (``debug``, ``info``, ``warning``, ``error``). With ``info``:

* ``smp.init`` prints one line describing the layout, on rank 0 (``layout_summary``);
* every ``SMP2DS_LOG_FREQ``-th call of an ``@smp.step`` function (default every call) prints,
  on every rank, the step number, the step's loss when the function returns one (the mean of
  its first output over this rank's micro-batches, no communication) and the step's wall time.

Lines go to standard error as ``[smp2ds rank R/W] LEVEL message`` through the ``smp2ds``
logger, so the engine's other log records (the configuration, pipeline notes) get the same tag.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from smp2ds.translator.plan_types import Plan

if TYPE_CHECKING:  # core imports diagnostics (the step log at smp.init): the annotation only
    from smp2ds.engine.core.launch_env import LaunchEnv

LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
ENV_LEVEL = "SMP2DS_LOG"
ENV_FREQ = "SMP2DS_LOG_FREQ"

log = logging.getLogger("smp2ds")


class _Progress:
    """Step counter and switches of this process (one per process, like SMP's state)."""

    enabled = False
    every = 1
    step = 0
    handler: logging.Handler | None = None


def configure(rank: int, world_size: int, environ: Mapping[str, str] | None = None) -> bool:
    """Install the rank-tagged handler when ``SMP2DS_LOG`` is set; True when step lines are on.

    Raises ValueError naming the variable, its value and what is allowed for a bad level or
    frequency. Without ``SMP2DS_LOG`` the logging setup of the script is left untouched.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_LEVEL, "").strip()
    level = raw.lower()
    if level and level not in LEVELS:
        raise ValueError(f"{ENV_LEVEL}={raw!r} is not a log level; allowed: {', '.join(LEVELS)}")
    every = _frequency(environ.get(ENV_FREQ, "1")) if level else 1
    if _Progress.handler is not None:  # a previous configure's: undo it
        log.removeHandler(_Progress.handler)
        log.setLevel(logging.NOTSET)
        log.propagate = True
        _Progress.handler = None
    if not level:
        _Progress.enabled = False
        return False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[smp2ds rank {rank}/{world_size}] %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(level.upper())
    log.propagate = False  # one line per record, even when the script configured the root logger
    _Progress.handler, _Progress.every, _Progress.step = handler, every, 0
    _Progress.enabled = log.isEnabledFor(logging.INFO)
    return _Progress.enabled


def _frequency(raw: str) -> int:
    try:
        every = int(raw.strip(), 10)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError(f"{ENV_FREQ}={raw!r} must be a whole number >= 1 (log every N-th step)")
    return every


def start_logging(plan: Plan, launch: LaunchEnv, backend: str) -> None:
    """At ``smp.init``: configure from the environment, then rank 0 logs the layout line."""
    configure(launch.rank, launch.world_size)
    if launch.rank == 0:
        log.info("%s", layout_summary(plan, launch.world_size, backend))


def layout_summary(plan: Plan, world_size: int, backend: str) -> str:
    """One line: degrees and placement, nodes, data-parallel scheme, micro-batches, precision, backend."""
    topo, settings = plan.topology_settings, plan.engine_settings
    mics = settings.mics
    rpn = topo.ranks_per_node
    pp, tp, rdp = topo.pipeline_parallel_degree, topo.tensor_parallel_degree, topo.rdp_degree
    stage = settings.zero_stage
    if mics.enabled:
        shard = mics.shard_size
        scheme = f"sharded data parallelism (MiCS, shard groups of {shard}, {rdp // shard} replica(s))"
    else:
        scheme = {0: "DDP", 1: "ZeRO-1 (shard_optimizer_state)", 2: "ZeRO-2", 3: "ZeRO-3"}[stage]
    precision = settings.precision.dtype
    return (
        f"layout: world {world_size} = pipeline {pp} x tensor {tp} x data-parallel {rdp} "
        f"(placement {topo.placement}), {-(-world_size // rpn)} node(s) x {rpn} rank(s); "
        f"{scheme}; {settings.microbatches} micro-batch(es) per step; {precision}; "
        f"backend {backend}"
    )


def step_started() -> float | None:
    """Called as an ``@smp.step`` call begins: its start time, or None when step lines are off."""
    return time.perf_counter() if _Progress.enabled else None


def step_finished(started: float | None, outputs: Any) -> None:
    """Called with the step's collected outputs: counts the step and logs every N-th."""
    if started is None:
        return
    _Progress.step += 1
    if _Progress.step % _Progress.every:
        return
    elapsed = time.perf_counter() - started
    loss = step_loss(outputs)
    shown = "n/a" if loss is None else f"{loss:.6g}"
    log.info("step %d: loss %s, step time %.3f s", _Progress.step, shown, elapsed)


def step_loss(outputs: Any) -> float | None:
    """The mean over micro-batches of the step's first output, when that is a scalar per micro-batch.

    A step function returns ``loss`` or ``(loss, ...)`` by convention; anything else (no output
    on this pipeline stage, logits, a dict) has no loss to show.
    """
    first = outputs[0] if isinstance(outputs, (tuple, list)) and outputs else outputs
    values = getattr(first, "outputs", None)  # a StepOutput: one value per micro-batch
    if not values:
        return None
    try:
        numbers = [float(v) for v in values]  # a 0-d tensor or a number; a wider tensor raises
    except (TypeError, ValueError, RuntimeError):
        return None
    return sum(numbers) / len(numbers)
