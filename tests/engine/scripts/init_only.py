"""Call smp.init() and report; used for configuration-error reporting tests."""

import smdistributed.modelparallel.torch as smp

smp.init({"ddp": True})
print("initialised", smp.rank())
