"""``smp.amp.GradScaler``: torch's gradient scaler, with SMP's pipeline-wide overflow decision.

SMP's scaler skips ``optimizer.step()`` on every pipeline stage if any stage found inf/NaN
gradients. With one stage this is torch's ``GradScaler``. It works with
``smp.DistributedOptimizer`` under plain data parallelism (gradients are reduced into the
parameters' ``.grad`` by the end of the step, where ``unscale_`` finds them); with
``shard_optimizer_state`` the gradients live in DeepSpeed's partitions — use ``fp16: true``
(DeepSpeed's own loss scaler) instead.
"""

from __future__ import annotations

from typing import Any

import torch

from smp2ds.engine.core import comm
from smp2ds.engine.core.state import state


class GradScaler(torch.amp.GradScaler):
    """Drop-in for ``torch.cuda.amp.GradScaler``; defaults to the CPU when CUDA is absent."""

    def __init__(self, *args: Any, **kwargs: Any):
        if not (args and isinstance(args[0], str)) and "device" not in kwargs:
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(*args, **kwargs)

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                        *args: Any, **kwargs: Any) -> Any:
        found = optimizer_state["found_inf_per_device"]
        if state.initialized and state.groups.topology.pp > 1:
            # Every stage must agree, or one stage would update while another skipped.
            flag = torch.tensor([sum(v.item() for v in found.values())], dtype=torch.float32)
            comm.all_reduce(flag, comm.ReduceOp.MAX, state.groups.group("pp"))
            for value in found.values():
                value.fill_(float(flag.item() > 0))
        if sum(v.item() for v in found.values()) == 0:
            return optimizer.step(*args, **kwargs)
        return None
