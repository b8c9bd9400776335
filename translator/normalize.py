"""Validated input -> frozen `SMPConfig`: aliases resolved, defaults filled, SMP's fix-ups applied.

``normalize(doc, layout)`` raises SMPConfigError with every problem (schema, cross-key rules and,
when the world size is known, SMP's world-size arithmetic). ``analyse`` is the shared pass that
``validate`` also uses: it keeps going after problems so all of them are reported at once,
building the config only from keys whose values passed the schema.

SMP's silent post-validation fix-ups are applied to ``params`` (``given`` keeps what the user
wrote, so ``given[k] != params[k]`` shows a fix-up): ``pipeline`` becomes ``interleaved`` when
``active_microbatches != microbatches``; ``checkpoint_attentions`` is off when
``pipeline_parallel_degree > 1``. ``fixups(config)`` lists them in words.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .document import Document, read_document
from .issues import Issue, SMPConfigError
from .load import resolve_parameters_file
from .plan_types import Layout, SMPConfig
from .schema_check import SCHEMA_FOR_KIND, schema_issues
from .semantics import (
    canonical_given,
    check_distribution,
    check_v1,
    check_v2,
    resolve_v1,
    v1_defaults,
    v2_defaults,
)
from .world_layout import check_world, resolve_layout

_NOT_OBJECT = "expected a JSON object: SMP parameters, an estimator `distribution` dict or an estimator spec"


def _apply_fixups(params: dict[str, Any]) -> None:
    # SMP's simple pipeline needs every microbatch in flight; otherwise it quietly interleaves.
    if params["active_microbatches"] != params["microbatches"] and params["pipeline"] != "interleaved":
        params["pipeline"] = "interleaved"
    # Attention checkpointing is only implemented without pipeline parallelism.
    if params["pipeline_parallel_degree"] > 1:
        params["checkpoint_attentions"] = False


def fixups(config: SMPConfig) -> list[str]:
    """SMP's silent changes to the user's values, in words (for plan notes)."""
    notes = []
    for key in ("pipeline", "checkpoint_attentions"):
        if key in config.given and config.given[key] != config.params[key]:
            notes.append(
                f"{key}: {config.given[key]!r} was changed to {config.params[key]!r} as SMP does "
                + (
                    "(active_microbatches != microbatches)"
                    if key == "pipeline"
                    else "(pipeline_parallel_degree > 1)"
                )
            )
    return notes


def _clean_params(doc: Document, issues: list[Issue], known: Mapping[str, Any]) -> dict[str, Any]:
    """The user's parameter keys whose values passed the schema (so the rules can trust types)."""
    if not isinstance(doc.params, Mapping):
        return {}
    bad = {issue.pointer for issue in issues}
    return {k: v for k, v in doc.params.items() if k in known and doc.pointer(k) not in bad}


def _block(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, Mapping) else {}


def _build(doc: Document, given: dict[str, Any]) -> SMPConfig:
    pointers = {k: doc.pointer(k) for k in given}
    if isinstance(doc.params, Mapping) and "$schema" in doc.params:
        # Editor metadata, not a setting: kept out of `given`, but explain still reports its fate.
        pointers["$schema"] = doc.pointer("$schema")
    mpi = _block(doc.mpi)
    if doc.distribution is not None:
        mpi.setdefault("enabled", False)
        mpi.setdefault("custom_mpi_options", "")
    count = doc.instance_count
    common: dict[str, Any] = {
        "kind": doc.kind,
        "mpi": mpi,
        "instance_type": doc.instance_type if isinstance(doc.instance_type, str) else None,
        "instance_count": count if isinstance(count, int) and not isinstance(count, bool) else None,
        "hyperparameters": _block(doc.hyperparameters),
        "environment": {k: str(v) for k, v in _block(doc.environment).items()},
        "pointers": pointers,
    }
    if doc.strategy == "dataparallel":
        params = resolve_v1({"ddp": True})
        return SMPConfig(params=params, given={}, strategy="dataparallel", **{**common, "pointers": {}})
    if doc.smp_version == 2:
        v2 = {**v2_defaults(), **given}
        # v1 view of a v2 config: data parallelism is always on and tensor parallelism means the
        # same; everything else (hybrid sharding, context/expert parallelism) is read from `v2`.
        params = resolve_v1({"ddp": True, "tensor_parallel_degree": v2["tensor_parallel_degree"]})
        return SMPConfig(params=params, given=given, smp_version=2, v2=v2, **common)
    params = resolve_v1(given)
    _apply_fixups(params)
    return SMPConfig(params=params, given=canonical_given(given), **common)


def analyse(doc: Any, layout: Layout | None = None) -> tuple[list[Issue], SMPConfig | None]:
    """Every problem of ``doc`` plus the config built from its valid parts (None if unusable)."""
    issues: list[Issue] = []
    try:
        doc = resolve_parameters_file(doc, os.getcwd())
    except SMPConfigError as err:
        issues.extend(err.issues)
    document = read_document(doc)
    if document is None:
        return [Issue("", _NOT_OBJECT, given=doc)], None
    issues.extend(schema_issues(doc, SCHEMA_FOR_KIND[document.kind], document))
    # Decided on input problems only: semantic issues also point at world keys.
    world_broken = _world_inputs_broken(document, issues)
    if isinstance(document.params, str):
        return issues, None  # the unreadable parameters file is already reported
    issues.extend(check_distribution(document))
    if document.strategy == "modelparallel":
        known = v2_defaults() if document.smp_version == 2 else {**v1_defaults(), "partitions": None}
        given = _clean_params(document, issues, known)
        if document.smp_version == 2:
            issues.extend(check_v2(document, given, {**v2_defaults(), **given}))
        else:
            issues.extend(check_v1(document, given, resolve_v1(given)))
    else:
        given = {}
    config = _build(document, given)
    if not world_broken:
        issues.extend(check_world(config, resolve_layout(config, layout)))
    return _unique(issues), config


_WORLD_KEYS = (
    "pipeline_parallel_degree",
    "partitions",
    "tensor_parallel_degree",
    "ddp",
    "horovod",
    "sharded_data_parallel_degree",
    "microbatches",
    "hybrid_shard_degree",
    "context_parallel_degree",
    "expert_parallel_degree",
)


def _world_inputs_broken(doc: Document, issues: list[Issue]) -> bool:
    """True when a value the world arithmetic uses was rejected: checking with its default would
    only add confusing follow-up errors."""
    bad = {issue.pointer for issue in issues}
    watched = {doc.pointer(k) for k in _WORLD_KEYS}
    watched |= {doc.dist_pointer("mpi", "processes_per_host"), "/instance_count", "/instance_type"}
    return bool(bad & watched)


def _unique(issues: list[Issue]) -> list[Issue]:
    seen: dict[tuple[str, str], Issue] = {}
    for issue in issues:
        seen.setdefault((issue.pointer, issue.message), issue)
    return sorted(seen.values(), key=lambda i: (i.pointer, i.message))


def normalize(doc: Any, layout: Layout | None = None) -> SMPConfig:
    """Validate ``doc`` and return the resolved SMPConfig; raise SMPConfigError listing every problem.

    ``doc`` may be a bare SMP v1 parameters dict, an estimator ``distribution`` dict, a whole
    estimator spec or an SMP v2 dict. World-size rules are checked when the world is known
    (``layout.world_size``, or instance_count x processes_per_host / GPUs of instance_type).
    """
    issues, config = analyse(doc, layout)
    if issues or config is None:
        raise SMPConfigError(issues or [Issue("", _NOT_OBJECT)])
    return config
