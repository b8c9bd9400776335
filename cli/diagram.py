"""Render ``smp2ds.translator.tools.diagram``'s rank grid and pipeline timeline with matplotlib.

matplotlib is the optional ``plot`` extra: `require_matplotlib` turns its absence into a usage
error (exit 2) that says how to install it. Only ``matplotlib.figure.Figure`` is used (no pyplot),
so no display or backend selection is involved; the file suffix picks SVG or PNG.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from smp2ds.translator.tools.diagram import RankGrid, Timeline

from . import UsageError

SUFFIXES = (".svg", ".png")
INSTALL = "pip install 'smp2ds[plot]'  (or: pip install matplotlib)"
_CELL_W, _CELL_H, _PER_ROW = 1.3, 0.95, 8
# One colour cycle for group membership: colour i = group i of that kind.
_PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac")
_KIND_TITLES = {"pp": "pipeline groups (pp): send activations / gradients between stages",
                "tp": "tensor-parallel groups (tp): all-reduce / all-gather inside each layer",
                "rdp": "reduced data-parallel groups (rdp): gradient all-reduce",
                "shard": "shard groups (sdp): parameter all-gather, gradient reduce-scatter",
                "replica": "replica groups (sdp): gradient all-reduce of each shard across replicas"}


def output_path(text: str) -> Path:
    """argparse type for ``--diagram`` / ``--schedule``: a path ending in .svg or .png."""
    import argparse

    path = Path(text)
    if path.suffix.lower() not in SUFFIXES:
        raise argparse.ArgumentTypeError(f"expected a file name ending in .svg or .png, got {text!r}")
    return path


def require_matplotlib() -> Any:
    """``matplotlib.figure.Figure``, or a UsageError naming the install command."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(f"drawing needs matplotlib, which is not installed; install it with: {INSTALL}") from None
    return Figure


def _cell_xy(grid: RankGrid, rank: int, top: float) -> tuple[float, float]:
    """Lower-left corner of ``rank``'s box in a panel whose top edge is at ``top``."""
    cell = grid.cell(rank)
    position = grid.node_ids.index(cell.node)  # among the drawn nodes
    rows_before = sum(-(-len(n) // _PER_ROW) for n in grid.nodes[:position])
    row = rows_before + cell.local_rank // _PER_ROW
    return (cell.local_rank % _PER_ROW) * _CELL_W, top - (row + 1) * _CELL_H - position * 0.45


def _panel(ax: Any, grid: RankGrid, title: str, colour_of: dict[int, str] | None,
           group_of: dict[int, int] | None = None) -> None:
    from matplotlib.patches import Rectangle

    rows = sum(-(-len(n) // _PER_ROW) for n in grid.nodes)
    height = rows * _CELL_H + len(grid.nodes) * 0.45
    for position, (n, ranks) in enumerate(zip(grid.node_ids, grid.nodes)):  # node boxes around their ranks
        xs, ys = zip(*(_cell_xy(grid, r, height) for r in ranks))
        ax.add_patch(Rectangle((min(xs) - 0.08, min(ys) - 0.08), max(xs) - min(xs) + _CELL_W + 0.16 - 0.1,
                               max(ys) - min(ys) + _CELL_H + 0.3, fill=False, lw=1.4, ec="#333333"))
        elided = f"   ({grid.elided_nodes} nodes like it not drawn)" if grid.elided_nodes and position == 1 else ""
        ax.text(min(xs), max(ys) + _CELL_H + 0.02, f"node {n}{elided}", fontsize=8, va="bottom")
    for cell in grid.cells:
        x, y = _cell_xy(grid, cell.rank, height)
        face = "#f4f4f4" if colour_of is None else colour_of.get(cell.rank, "#ffffff")
        ax.add_patch(Rectangle((x, y), _CELL_W - 0.1, _CELL_H - 0.1, fc=face, ec="#555555", lw=0.6))
        # beyond the palette's 10 colours groups share a colour: the group number tells them apart
        text = cell.label if colour_of is None else f"r{cell.rank}\ng{(group_of or {}).get(cell.rank, '-')}"
        ax.text(x + (_CELL_W - 0.1) / 2, y + (_CELL_H - 0.1) / 2, text, ha="center", va="center",
                fontsize=6.5 if colour_of is None else 8)
    ax.set_xlim(-0.2, _PER_ROW * _CELL_W + 0.1)
    ax.set_ylim(-0.1, height + 0.45)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=9, loc="left")


def render_grid(grid: RankGrid, path: Path) -> None:
    """Write the rank grid: one labelled panel, then one panel per group kind coloured by group."""
    figure = require_matplotlib()
    kinds = list(grid.groups)
    rows = sum(-(-len(n) // _PER_ROW) for n in grid.nodes)
    panel_h = 0.9 * rows + 0.6 * len(grid.nodes) + 0.6
    fig = figure(figsize=(9.5, panel_h * (1 + len(kinds))))
    axes = fig.subplots(1 + len(kinds), 1, squeeze=False)[:, 0]
    _panel(axes[0], grid, grid.title, None)
    for ax, kind in zip(axes[1:], kinds):
        colours = {r: _PALETTE[i % len(_PALETTE)] for i, g in enumerate(grid.groups[kind]) for r in g}
        numbers = {r: i for i, g in enumerate(grid.groups[kind]) for r in g}
        count = len(grid.groups[kind])
        _panel(ax, grid, f"{_KIND_TITLES[kind]}: {count} group{'s' * (count != 1)}", colours, numbers)
    fig.tight_layout()
    fig.savefig(path)


def render_timeline(timeline: Timeline, path: Path) -> None:
    """Write the pipeline schedule: stages as rows, passes as boxes over time, idle time shaded."""
    figure = require_matplotlib()
    from matplotlib.patches import Patch, Rectangle

    fig = figure(figsize=(max(6.0, 0.45 * timeline.makespan + 2), 0.55 * timeline.stages + 1.6))
    ax = fig.subplots()
    for s in range(timeline.stages):  # the bubble: the whole row shaded, passes drawn over it
        ax.add_patch(Rectangle((0, s - 0.4), timeline.makespan, 0.8, fc="#dddddd", hatch="//", ec="#bbbbbb",
                               lw=0))
    for p in timeline.passes:
        face = "#4e79a7" if p.phase == "F" else "#f28e2b"
        ax.add_patch(Rectangle((p.start, p.stage - 0.4), p.end - p.start, 0.8, fc=face, ec="white", lw=1))
        ax.text((p.start + p.end) / 2, p.stage, f"{p.phase}{p.microbatch}", ha="center", va="center",
                fontsize=8, color="white")
    ax.set_xlim(0, timeline.makespan)
    ax.set_ylim(timeline.stages - 0.5, -0.5)
    ax.set_yticks(range(timeline.stages), [f"stage {s}" for s in range(timeline.stages)])
    ax.set_xlabel("time (forward pass = 1, backward pass = 2; communication not drawn)")
    group = f", groups of {timeline.group_size}" if timeline.kind == "gpipe" else ""
    ax.set_title(f"{timeline.kind}{group}: {timeline.stages} stages x {timeline.microbatches} micro-batches, "
                 f"bubble {timeline.bubble_fraction:.0%} of stage time", fontsize=9, loc="left")
    ax.legend(handles=[Patch(fc="#4e79a7", label="forward"), Patch(fc="#f28e2b", label="backward"),
                       Patch(fc="#dddddd", hatch="//", label="idle (bubble)")],
              loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
