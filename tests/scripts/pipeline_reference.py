"""The single-process reference of the pipeline script tests: a script module's model trained on its global
batches, each step's batch cut into micro-batches whose losses are averaged into one backward, as the pipeline
engine does."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any


def load_script(path: Path) -> Any:
    """The script at ``path`` imported as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def micro_batched_reference(path: Path, steps: int, micro: int, make_optimizer: Callable[[Any, Any], Any]) -> dict:
    """``{"losses": per step, the micro-batch losses; "state": final state dict}`` of the script's
    ``make_model()`` trained on ``global_batch(step, 1)`` with ``make_optimizer(script, parameters)``."""
    script = load_script(path)
    model = script.make_model()
    opt = make_optimizer(script, model.parameters())
    losses = []
    for step in range(steps):
        ids, mask = script.global_batch(step, 1)
        mine = []
        for i, m in zip(ids.chunk(micro), mask.chunk(micro)):
            loss = model(input_ids=i, attention_mask=m, labels=i).loss
            (loss / micro).backward()
            mine.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        losses.append(mine)
    return {"losses": losses, "state": model.state_dict()}
