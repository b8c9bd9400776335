"""SMP's exception classes (re-exported from ``smp2ds.engine.exceptions``)."""

from smp2ds.engine.exceptions import *
from smp2ds.engine.exceptions import __all__  # noqa: F401
