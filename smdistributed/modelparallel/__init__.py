"""``smdistributed.modelparallel``: SageMaker model parallel v1, reimplemented on DeepSpeed by smp2ds.

``__version__`` reports the API level smp2ds reproduces, 1.15.0, the last SMP v1 release
(docs/smp-semantics.md#python-api). Clients switch code paths on it — transformers uses the SMP >= 1.10
paths (``save_checkpoint``/``resume_from_checkpoint``, ``.pt`` partial names) only when the
version says so — so it must read as a 1.x release of at least 1.10.
"""

__version__ = "1.15.0"
