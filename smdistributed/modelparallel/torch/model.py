"""``smp.model`` (transformers checks ``isinstance(x, smp.model.DistributedModel)``)."""

from smp2ds.engine.api.model import DistributedModel

__all__ = ["DistributedModel"]
