"""``python -m smp2ds.cli``: the same as the ``smp2ds`` console script."""

import sys

from . import main

sys.exit(main())
