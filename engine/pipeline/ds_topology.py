"""SMP rank layout -> DeepSpeed `ProcessTopology` with the same rank order.

SMP's ``placement_strategy`` is a permutation of D (reduced data parallel), P (pipeline) and T
(tensor) whose right-most letter varies fastest over consecutive ranks. DeepSpeed's
`ProcessTopology(axes, dims)` is row-major: its last axis varies fastest. So the SMP letters,
read left to right, are exactly DeepSpeed's axes from slowest to fastest, with P -> ``pipe``,
D -> ``data`` and T -> ``model``. DeepSpeed's own default (`PipeModelDataParallelTopology`) is
``pipe, data, model`` = SMP ``PDT``; SMP's default ``cluster`` is ``DPT``, so the mapping must be
explicit.
"""

from __future__ import annotations

from deepspeed.runtime.pipe.topology import ProcessTopology

from smp2ds.translator.topology import Topology

AXIS_OF_LETTER = {"P": "pipe", "D": "data", "T": "model"}


def axes_and_dims(topology: Topology) -> tuple[list[str], list[int]]:
    """DeepSpeed axis names (slowest first) and sizes for an SMP layout; pure, no torch."""
    sizes = {"P": topology.pp, "D": topology.rdp, "T": topology.tp}
    order = topology.order
    return [AXIS_OF_LETTER[c] for c in order], [sizes[c] for c in order]


def to_ds_topology(topology: Topology) -> ProcessTopology:
    """A `ProcessTopology` whose rank -> (pipe, data, model) matches SMP's (pp, rdp, tp) coords."""
    axes, dims = axes_and_dims(topology)
    return ProcessTopology(axes=axes, dims=dims)
