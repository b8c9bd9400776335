"""How a tensor-parallel parameter is cut from its full tensor, and put back together.

A :class:`ShardSpec` rides on each sharded parameter (attribute ``_smp2ds_shard``). The full
tensor's dimension ``dim`` is read as ``blocks`` equal consecutive blocks (3 for a fused
query/key/value projection, 1 otherwise); every block is cut into ``size`` equal pieces and rank
``r`` keeps piece ``r`` of every block, in block order. Cutting per block is what keeps whole
attention heads of q, k and v together on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.nn.parallel.group import TPGroup

ATTR = "_smp2ds_shard"


@dataclass(frozen=True)
class ShardSpec:
    """Where a parameter's local piece sits in the full tensor."""

    dim: int
    size: int
    blocks: int = 1
    full_shape: tuple[int, ...] = ()

    def check(self, full: torch.Size | tuple[int, ...], name: str) -> None:
        extent = full[self.dim]
        if extent % (self.blocks * self.size):
            raise ValueError(f"{name}: dimension {self.dim} of size {extent} cannot be split into {self.blocks} "
                             f"block(s) x tensor_parallel_degree {self.size}")

    def local(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of ``full`` (a copy)."""
        blocks = full.chunk(self.blocks, dim=self.dim)
        return torch.cat([b.chunk(self.size, dim=self.dim)[rank] for b in blocks], dim=self.dim).clone()

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's piece (indexed by tensor-parallel rank)."""
        per_rank = [p.chunk(self.blocks, dim=self.dim) for p in pieces]
        return torch.cat([per_rank[r][b] for b in range(self.blocks) for r in range(self.size)], dim=self.dim)


def spec_of(tensor: torch.Tensor) -> ShardSpec | None:
    return getattr(tensor, ATTR, None)


def shard_parameter(module: torch.nn.Module, name: str, spec: ShardSpec, rank: int) -> torch.nn.Parameter:
    """Replace ``module.<name>`` by this rank's piece, keeping the name (and marking it for DeepSpeed's
    model-parallel gradient norm)."""
    full = getattr(module, name)
    spec.check(full.shape, name)
    spec = ShardSpec(spec.dim, spec.size, spec.blocks, tuple(full.shape))
    local = torch.nn.Parameter(spec.local(full.detach(), rank), requires_grad=full.requires_grad)
    setattr(local, ATTR, spec)
    local.tensor_model_parallel = True  # DeepSpeed's is_model_parallel_parameter
    local.partition_dim = spec.dim
    setattr(module, name, local)
    return local


def full_tensor(local: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The full tensor of a sharded parameter (collective over the tensor-parallel group)."""
    spec = spec_of(local)
    if spec is None or tp.size == 1:
        return local
    return spec.join(comm.all_gather(local.detach(), group=tp.handle))


def local_part(target: torch.Tensor, value: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``value`` as ``target`` holds it: a full tensor loaded into a shard is cut to this rank's
    piece; anything else (a shard, a replicated tensor) passes unchanged."""
    spec = spec_of(target)
    if spec is not None and tuple(value.shape) == spec.full_shape and tuple(value.shape) != tuple(target.shape):
        return spec.local(value, tp.rank)
    return value
