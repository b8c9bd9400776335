"""Tensor parallelism (SMP ``tensor_parallel_degree > 1``): not implemented yet.

This package is the place for it: Megatron-style column/row-parallel layers that shard existing
modules in place, the Hugging Face sharding rules and ``smp.nn``'s distributed modules, with a
``backend.py`` implementing :class:`smp2ds.engine.core.backend.Backend`. Until then the
translator reports ``tensor_parallel_degree > 1`` as unsupported and ``smp.init`` refuses it with
that reason (:data:`UNSUPPORTED_REASON`, the translator's words).
"""

from smp2ds.translator.tensor_parallel import TP_UNSUPPORTED as UNSUPPORTED_REASON

__all__ = ["UNSUPPORTED_REASON"]
