"""The chosen split of a layer list into stages, and how it was chosen.

`plan_partition` applies SMP's rules: with ``auto_partition`` (the default) the memory/compute
cost model of `balance`; without it the ``smp.partition`` / ``smp.set_partition`` assignments of
`manual`, unassigned modules going to ``default_partition``. The resulting `PartitionPlan` is
what the runner hands DeepSpeed, what the log line prints and what ``smp2ds explain`` can show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from smp2ds.engine.pipeline import manual
from smp2ds.engine.pipeline.balance import balance, layer_costs, manual_parts
from smp2ds.engine.pipeline.layers import LayerList

_GB = float(1 << 20)


@dataclass(frozen=True, kw_only=True)
class StageInfo:
    """One stage of the split."""

    stage: int
    start: int
    stop: int
    layers: tuple[str, ...]
    memory_bytes: int
    compute: float
    cost: float


@dataclass(frozen=True, kw_only=True)
class PartitionPlan:
    """Stage boundaries (DeepSpeed ``parts``) with the numbers behind them."""

    method: str
    """``"auto"`` (cost model) or ``"manual"`` (smp.partition / set_partition)."""
    memory_weight: float
    parts: tuple[int, ...]
    stages: tuple[StageInfo, ...]

    def stage_of(self, layer_index: int) -> int:
        """The stage that owns layer ``layer_index``."""
        for info in self.stages:
            if info.start <= layer_index < info.stop:
                return info.stage
        raise IndexError(f"layer {layer_index} is outside 0..{self.parts[-1] - 1}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready description (for ``smp2ds explain`` and logs)."""
        return {
            "method": self.method,
            "memory_weight": self.memory_weight,
            "parts": list(self.parts),
            "stages": [{"stage": s.stage, "layers": list(s.layers), "first_layer": s.start, "last_layer": s.stop - 1,
                        "parameter_bytes": s.memory_bytes, "compute_proxy": s.compute, "cost_share": round(s.cost, 6)}
                       for s in self.stages],
        }

    def describe(self) -> str:
        """One log line: method, then per stage its layer range, first/last layer and shares."""
        head = (f"pipeline split ({self.method}" +
                (f", memory_weight={self.memory_weight:g}" if self.method == "auto" else "") + "): ")
        parts = []
        for s in self.stages:
            span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
            parts.append(f"stage {s.stage} = layers {s.start}-{s.stop - 1} [{span}] "
                         f"{s.memory_bytes / _GB:.2f} MiB params, cost {s.cost:.0%}")
        return head + "; ".join(parts)


def plan_partition(layer_list: LayerList, stages: int, *, auto: bool = True, memory_weight: float = 0.8,
                   default_partition: int | None = 0) -> PartitionPlan:
    """Split ``layer_list`` into ``stages`` contiguous stages by SMP's rules (see module doc)."""
    memory = [layer.memory for layer in layer_list.layers]
    compute = [layer.flops for layer in layer_list.layers]
    costs = layer_costs(memory, compute, memory_weight)
    names = layer_list.names
    if auto:
        parts = balance(costs, stages)
    else:
        parts = manual_parts(manual_stages(layer_list, default_partition or 0), stages, names)
    infos = tuple(
        StageInfo(stage=s, start=parts[s], stop=parts[s + 1], layers=tuple(names[parts[s]:parts[s + 1]]),
                  memory_bytes=sum(memory[parts[s]:parts[s + 1]]), compute=sum(compute[parts[s]:parts[s + 1]]),
                  cost=sum(costs[parts[s]:parts[s + 1]]))
        for s in range(stages))
    return PartitionPlan(method="auto" if auto else "manual", memory_weight=float(memory_weight),
                         parts=tuple(parts), stages=infos)


def manual_stages(layer_list: LayerList, default_partition: int) -> list[int]:
    """One stage per layer from the manual assignments; a layer's owners must agree."""
    effective = manual.effective_partitions(layer_list.model, default_partition)
    out, problems = [], []
    for i, layer in enumerate(layer_list.layers):
        found = sorted({effective.get(id(m), default_partition) for m in layer.owners})
        if len(found) > 1:
            problems.append(f"layer {i} ({layer.name}) mixes modules assigned to partitions {found}; "
                            "one pipeline layer runs on one stage")
        out.append(found[0])
    if problems:
        raise ValueError("manual pipeline partition is not usable:\n  " + "\n  ".join(problems))
    return out
