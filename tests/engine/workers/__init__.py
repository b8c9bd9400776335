"""Functions the multi-rank tests run on each rank (``tests._dist.run_ranks``), one module per subject."""
