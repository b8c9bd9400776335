"""What a backend asks of a tensor-parallel model: the contract between ``parallelize`` (the
tensor-parallel package) and the backends that drive DeepSpeed engines (plain, MiCS, pipeline), which
may not import that package. The backend factory hands the one to the other."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # process_groups imports comm (torch.distributed); this protocol module stays light
    from smp2ds.engine.core.process_groups import ProcessGroups


class TensorParallelView(Protocol):
    """A model whose marked modules are sharded over this rank's tensor-parallel group."""

    @property
    def size(self) -> int:
        """Ranks in the tensor-parallel group (1: nothing is sharded and every method is the identity)."""

    @property
    def group(self) -> Any:
        """This rank's tensor-parallel group (``handle``, ``size``, ``rank``, ``src``)."""

    def deepspeed_mpu(self, groups: ProcessGroups) -> Any:
        """DeepSpeed's ``mpu`` for data parallelism over the reduced-data-parallel group."""

    def join(self, state_dict: Mapping[str, Any], keep_vars: bool = False) -> dict[str, Any]:
        """Shards joined into whole tensors, other entries kept (collective over the group)."""

    def cut(self, own: Mapping[str, Any], state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Whole tensors cut to this rank's shard of the matching ``own`` entry; shards kept."""

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole tensor of one shard (itself when not sharded; collective for shards)."""

    def local_part(self, target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` (whole or a shard) as this rank's part of ``target``."""

    def check_equal_batches(self, args: tuple, kwargs: dict) -> None:
        """Refuse unequal batch sizes in the group when it joins batches (``prescaled_batch: false``)."""

    def gradient_correction(self, params: Iterable[torch.nn.Parameter],
                            optimizer: Any) -> Callable[[list[torch.nn.Parameter]], None] | None:
        """What turns per-rank gradients into the group's before DeepSpeed reduces them: None when nothing is
        needed or gradient hooks were installed (optimizers that take every backward's gradients at once)."""

    def grad_norm(self, params: Iterable[torch.nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
        """Gradient norm over the group: shards summed, replicated tensors once."""
