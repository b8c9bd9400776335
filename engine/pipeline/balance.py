"""Splitting a layer list into contiguous stages: SMP's cost model and a manual check.

Pure Python (no torch): inputs are per-layer numbers, outputs are stage boundaries
``parts`` in DeepSpeed's convention (``len == stages + 1``; stage ``s`` owns layers
``parts[s]:parts[s+1]``).

Cost (SMP's ``memory_weight`` objective, docs/smp-semantics.md#parameters)::

    cost_i = w * memory_i / sum(memory) + (1 - w) * compute_i / sum(compute)

``memory_i`` is the parameter bytes layer ``i`` holds; ``compute_i`` is a forward-FLOP proxy
(see `layers.compute_proxy`). Both are normalised so ``w`` weighs shares, not units. The split
minimises the largest stage cost exactly (dynamic programming over contiguous splits, every stage
non-empty); among equally good splits the one with the smaller sum of squared stage costs wins,
then the one found first.
"""

from __future__ import annotations

from collections.abc import Sequence


def layer_costs(memory: Sequence[float], compute: Sequence[float], memory_weight: float) -> list[float]:
    """Per-layer cost shares (they sum to 1 unless every layer is free)."""
    if len(memory) != len(compute):
        raise ValueError(f"memory has {len(memory)} layers but compute has {len(compute)}")
    total_m, total_c = float(sum(memory)), float(sum(compute))
    w = float(memory_weight)
    out = []
    for mem, comp in zip(memory, compute):
        share_m = mem / total_m if total_m > 0 else 0.0
        share_c = comp / total_c if total_c > 0 else 0.0
        out.append(w * share_m + (1.0 - w) * share_c)
    return out


def balance(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``stages`` non-empty parts minimising the largest part."""
    n = len(costs)
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if n < stages:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty pipeline stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = (float("inf"), float("inf"))
    # best[k][j]: (max part, sum of squares) splitting the first j layers into k parts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev == inf:
                    continue
                part = prefix[j] - prefix[i]
                cand = (max(prev[0], part), prev[1] + part * part)
                if _better(cand, best[k][j]):
                    best[k][j], cut[k][j] = cand, i
    parts = [n]
    j = n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        parts.append(j)
    return parts[::-1]


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    # Costs are sums of floats: compare with a tolerance so rounding never decides a split.
    tol = 1e-12
    if a[0] < b[0] - tol:
        return True
    if a[0] > b[0] + tol:
        return False
    return a[1] < b[1] - tol


def manual_parts(stage_of_layer: Sequence[int], stages: int, names: Sequence[str]) -> list[int]:
    """Stage boundaries from one stage index per layer; raise ValueError naming the culprits.

    The assignment must be non-decreasing along the layer list (DeepSpeed stages are contiguous
    runs of layers) and give every stage at least one layer.
    """
    problems = []
    for i, s in enumerate(stage_of_layer):
        if not 0 <= s < stages:
            problems.append(f"layer {i} ({names[i]}) is assigned to partition {s}, outside 0..{stages - 1}")
    for i in range(1, len(stage_of_layer)):
        if stage_of_layer[i] < stage_of_layer[i - 1]:
            problems.append(
                f"layer {i} ({names[i]}) is on partition {stage_of_layer[i]} but comes after layer {i - 1} "
                f"({names[i - 1]}) on partition {stage_of_layer[i - 1]}; stages must be contiguous runs of "
                "layers in forward order")
    counts = [0] * stages
    for s in stage_of_layer:
        if 0 <= s < stages:
            counts[s] += 1
    empty = [s for s, c in enumerate(counts) if c == 0]
    if empty and not problems:
        problems.append(f"partition(s) {empty} received no layers; every stage needs at least one")
    if problems:
        raise ValueError("manual pipeline partition is not usable:\n  " + "\n  ".join(problems))
    parts = [0]
    for s in range(stages):
        parts.append(parts[-1] + counts[s])
    return parts
