"""``smdistributed.modelparallel.backend``: only ``exceptions`` is provided (the SageMaker
training toolkit imports it to classify failures)."""
