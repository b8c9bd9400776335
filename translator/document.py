"""What kind of document the user gave, and where its pieces are.

Four input shapes reach the translator (docs/internals.md#inputs-and-the-plan): a bare SMP v1 ``parameters``
dict, an estimator ``distribution`` dict, a whole estimator spec and an SMP v2 dict. This module
recognises the shape and extracts the SMP parameters, the launcher blocks and the estimator
fields, each with its path, so every later issue can point into the document as the user wrote
it (``/distribution/smdistributed/modelparallel/parameters/microbatches``).

How SMP v2 is recognised (decided here, documented in the schemas):
  * a distribution with ``smdistributed.modelparallel`` and ``torch_distributed.enabled: true``
    (the SDK's SMP v2 launch; SMP v1 needs MPI), or
  * a bare dict holding any key that exists only in SMP v2 (``hybrid_shard_degree``,
    ``context_parallel_degree``, ...). Keys shared by both (``tensor_parallel_degree``,
    ``activation_loading_horizon``) alone mean SMP v1.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .plan_types import SourceKind, Strategy

DISTRIBUTION_KEYS = frozenset({"smdistributed", "mpi", "torch_distributed", "pytorchddp"})
# Keys that exist only in SMP v2 (docs/smp-semantics.md#smp-v2); their presence makes a bare dict v2.
V2_ONLY_KEYS = frozenset(
    {
        "hybrid_shard_degree",
        "sm_activation_offloading",
        "fsdp_cache_flush_warnings",
        "allow_empty_shards",
        "context_parallel_degree",
        "expert_parallel_degree",
        "random_seed",
    }
)
# Estimator-level keys that are never SMP parameters (a document holding one is an estimator spec).
ESTIMATOR_MARKERS = frozenset(
    {
        "distribution",
        "instance_count",
        "instance_type",
        "hyperparameters",
        "entry_point",
        "source_dir",
        "framework_version",
        "py_version",
        "image_uri",
        "role",
        "base_job_name",
        "volume_size",
        "max_run",
    }
)
PARAMS_PATH_IN_DISTRIBUTION: tuple[str, ...] = ("smdistributed", "modelparallel", "parameters")


def escape(token: Any) -> str:
    """Escape one reference token per RFC 6901 (``~`` -> ``~0``, ``/`` -> ``~1``)."""
    return str(token).replace("~", "~0").replace("/", "~1")


def pointer_of(path: Iterable[Any]) -> str:
    """RFC 6901 JSON pointer for a path of keys/indices; ``()`` is the root ``""``."""
    return "".join("/" + escape(token) for token in path)


def detect_kind(doc: Any) -> SourceKind | None:
    """Which of the four shapes ``doc`` is; None when it is not a JSON object at all."""
    if not isinstance(doc, Mapping):
        return None
    keys = set(doc)
    if keys & ESTIMATOR_MARKERS:
        return "estimator"
    if keys & DISTRIBUTION_KEYS:
        return "distribution"
    if keys & V2_ONLY_KEYS:
        return "smp_v2"
    return "parameters"


def _get(node: Any, key: str) -> Any:
    return node.get(key) if isinstance(node, Mapping) else None


def _enabled(block: Any) -> bool:
    return isinstance(block, Mapping) and block.get("enabled") is True


@dataclass(frozen=True)
class Document:
    """The recognised pieces of one input document (values as given, not yet validated)."""

    root: Any
    kind: SourceKind
    strategy: Strategy = "modelparallel"
    smp_version: int = 1
    params: Any = None
    """The SMP parameter dict (v1 or v2) as given; a string when it names a file; None if absent."""
    params_path: tuple[Any, ...] = ()
    """Path of ``params`` in ``root`` (where a missing key would go for dataparallel input too)."""
    distribution: Any = None
    distribution_path: tuple[Any, ...] | None = None
    mpi: Mapping[str, Any] = field(default_factory=dict)
    instance_type: Any = None
    instance_count: Any = None
    hyperparameters: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, Any] = field(default_factory=dict)
    """The estimator's ``environment``: variables SageMaker set in the training container."""

    @property
    def base(self) -> tuple[Any, ...]:
        """Path from the estimator root to ``root`` (how suggest.py places misplaced keys)."""
        if self.kind == "estimator":
            return ()
        if self.kind == "distribution":
            return ("distribution",)
        return ("distribution",) + PARAMS_PATH_IN_DISTRIBUTION

    def pointer(self, *path: Any) -> str:
        """Pointer of ``path`` inside the SMP parameters."""
        return pointer_of(self.params_path + tuple(path))

    def dist_pointer(self, *path: Any) -> str:
        """Pointer of ``path`` inside the distribution dict (root pointer if there is none)."""
        return pointer_of((self.distribution_path or ()) + tuple(path))


def read_document(doc: Any) -> Document | None:
    """Recognise ``doc`` and extract its pieces; None when it is not a JSON object."""
    kind = detect_kind(doc)
    if kind is None:
        return None
    if kind in ("parameters", "smp_v2"):
        return Document(root=doc, kind=kind, smp_version=2 if kind == "smp_v2" else 1, params=doc)
    if kind == "estimator":
        dist_path: tuple[str, ...] = ("distribution",)
        dist = doc.get("distribution")
        hyper, environment = doc.get("hyperparameters"), doc.get("environment")
        extra = {
            "instance_type": doc.get("instance_type"),
            "instance_count": doc.get("instance_count"),
            "hyperparameters": hyper if isinstance(hyper, Mapping) else {},
            "environment": environment if isinstance(environment, Mapping) else {},
        }
    else:
        dist, dist_path, extra = doc, (), {}
    smd = _get(dist, "smdistributed")
    mpi = _get(dist, "mpi")
    if isinstance(smd, Mapping) and "modelparallel" in smd:
        strategy: Strategy = "modelparallel"
        mp = smd["modelparallel"]
        params = _get(mp, "parameters")
        if params is None:
            params = {}
    else:
        # smdistributed.dataparallel, or a plain DDP launcher (pytorchddp / torch_distributed / mpi
        # alone): all plain data parallelism.
        strategy, params = "dataparallel", {}
    version = 2 if strategy == "modelparallel" and _enabled(_get(dist, "torch_distributed")) else 1
    return Document(
        root=doc,
        kind=kind,
        strategy=strategy,
        smp_version=version,
        params=params,
        params_path=dist_path + PARAMS_PATH_IN_DISTRIBUTION,
        distribution=dist,
        distribution_path=dist_path,
        mpi=mpi if isinstance(mpi, Mapping) else {},
        **extra,
    )
