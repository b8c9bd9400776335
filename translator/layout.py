import sys as _s
import smp2ds.translator.world_layout as _m
_s.modules[__name__] = _m  # TEMP shim while a benchmark runs
