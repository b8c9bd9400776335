"""``smp.model`` (transformers checks ``isinstance(x, smp.model.DistributedModel)``)."""

from smp2ds.engine.core.model import DistributedModel

__all__ = ["DistributedModel"]
