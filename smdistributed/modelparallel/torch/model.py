"""``smp.model`` (transformers checks ``isinstance(x, smp.model.DistributedModel)``)."""

from smp2ds.engine.model import DistributedModel

__all__ = ["DistributedModel"]
