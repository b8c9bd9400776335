"""DeepSpeed `PipelineModule` that takes its stage boundaries from our `PartitionPlan`.

DeepSpeed partitions by its own ``partition_method`` strings (uniform, parameter count, layer
type); SMP's memory/compute cost and manual placement are neither, so this subclass replaces
``_partition_layers`` with the boundaries computed beforehand (the same on every rank). The rest
of `PipelineModule` (building only the local layers, tied-weight groups, activation
checkpointing) is DeepSpeed's own, except that a stage's output is made contiguous before DeepSpeed
sends it: point-to-point sends (gloo's and NCCL's) refuse a strided view, which a stage ending in a
transpose or a slice returns (an encoder-decoder's stage outputs, for example).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.topology import ProcessTopology


class PlannedPipelineModule(PipelineModule):
    """A `PipelineModule` whose ``parts`` are given, not computed by DeepSpeed."""

    def __init__(self, layers: Sequence[Any], parts: Sequence[int], topology: ProcessTopology,
                 loss_fn: Callable[[Any, Any], Any] | None = None, activation_checkpoint_interval: int = 0):
        if len(parts) != topology.get_dim("pipe") + 1 or parts[0] != 0 or parts[-1] != len(layers):
            raise ValueError(f"parts {list(parts)} do not split {len(layers)} layers into "
                             f"{topology.get_dim('pipe')} stages")
        # Read by _partition_layers, which PipelineModule.__init__ calls before anything else
        # touches the layers; set before nn.Module.__init__, so bypass its __setattr__.
        object.__setattr__(self, "_planned_parts", [int(p) for p in parts])
        super().__init__(layers=list(layers), topology=topology, loss_fn=loss_fn,
                         activation_checkpoint_interval=activation_checkpoint_interval)

    def _partition_layers(self, method: str = "uniform") -> None:
        self.parts = list(self._planned_parts)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def forward(self, forward_input: Any) -> Any:
        """DeepSpeed's stage forward, every tensor of its output contiguous (what the next stage receives)."""
        return contiguous(super().forward(forward_input))


def contiguous(value: Any) -> Any:
    """``value`` with each tensor (also inside tuples and lists) contiguous; already contiguous ones unchanged."""
    if isinstance(value, torch.Tensor):
        return value if value.is_contiguous() else value.contiguous()
    if isinstance(value, (tuple, list)):
        return type(value)(contiguous(v) for v in value)
    return value
