"""``smp.nn.huggingface`` (re-exported from ``smp2ds.engine.nn.huggingface``)."""

from smp2ds.engine.nn.huggingface import *  # noqa: F403
