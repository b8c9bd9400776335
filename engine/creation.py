import sys as _s
import smp2ds.engine.api.creation as _m
_s.modules[__name__] = _m  # TEMP shim while a benchmark runs
