"""Per-rank peak memory of one training step, before any GPU is used (``smp2ds explain --memory``).

The parts a tracer can see (parameters, gradients, activations saved for backward and the
transient tensors of forward and backward) come from running one real forward and backward of
the user's model, cut the way the engine cuts it, on PyTorch fake tensors under
``torch.distributed._tools.mem_tracker.MemTracker`` (:mod:`.step_trace`). The parts no tracer sees
(DeepSpeed's fp32 copies, the optimizer's moments after ZeRO-1 or MiCS sharding and DeepSpeed's
gradient buckets) are formulas, each with its reason (:mod:`.model_states`). :mod:`.estimate`
puts them together for each rank role (pipeline stage x tensor-parallel rank).
"""

from smp2ds.engine.memory.estimate import MemoryEstimate, RoleMemory, estimate_memory
from smp2ds.engine.memory.model_source import ModelSource, load_model_source

__all__ = ["MemoryEstimate", "ModelSource", "RoleMemory", "estimate_memory", "load_model_source"]
