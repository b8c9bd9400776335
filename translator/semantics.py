"""Cross-key rules of SMP (docs/smp-semantics.md#cross-key-rules) and of the estimator `distribution`.

Every rule lives here, reports an Issue at the pointer of the key that asks for something
(``tensor_parallel_degree`` for "tp > 1 needs ddp"), prints the values involved and says how to
fix it. Like SMP, a ``requires`` rule only fires when the key differs from its default.
World-size arithmetic needs a layout and lives in world_layout.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from smp2ds.schemas import load_schema

from .document import Document
from .issues import Issue

ALIASES: dict[str, str] = {"partitions": "pipeline_parallel_degree"}


@lru_cache(maxsize=1)
def v1_defaults() -> dict[str, Any]:
    """Every canonical SMP v1 key -> its default (``None`` for formula defaults)."""
    props = load_schema("smp_v1")["properties"]
    return {name: spec.get("default") for name, spec in props.items() if name not in ALIASES}


@lru_cache(maxsize=1)
def v2_defaults() -> dict[str, Any]:
    """Every SMP v2 key -> its default."""
    return {name: spec.get("default") for name, spec in load_schema("smp_v2")["properties"].items()}


def canonical_given(given: Mapping[str, Any]) -> dict[str, Any]:
    """Rename aliases to canonical keys; the canonical spelling wins when both are present."""
    out = {k: v for k, v in given.items() if k not in ALIASES}
    for alias, canonical in ALIASES.items():
        if alias in given and canonical not in out:
            out[canonical] = given[alias]
    return out


def resolve_v1(given: Mapping[str, Any]) -> dict[str, Any]:
    """All canonical v1 keys: the user's values over the defaults, formula defaults computed.

    ``active_microbatches`` defaults to ``pipeline_parallel_degree + 2`` clamped into
    ``[1, microbatches]`` as SMP's loader clamps formula defaults into their bounds.
    """
    params = dict(v1_defaults())
    params.update(canonical_given(given))
    if params.get("active_microbatches") is None:
        params["active_microbatches"] = max(
            1, min(params["pipeline_parallel_degree"] + 2, params["microbatches"])
        )
    return params


def _show(value: Any) -> str:
    return json.dumps(value)


Rule = Callable[[Mapping[str, Any], Mapping[str, Any], Callable[[str], str]], list[Issue]]


def _alias_conflict(given, p, at) -> list[Issue]:
    if "partitions" in given and "pipeline_parallel_degree" in given:
        a, b = given["partitions"], given["pipeline_parallel_degree"]
        if a != b:
            return [
                Issue(
                    at("partitions"),
                    f"conflicting values: partitions({a}) and pipeline_parallel_degree({b}) are the same "
                    "setting (partitions is its alias)",
                    given=a,
                    hint="remove `partitions` or give both the same value",
                )
            ]
    return []


def _needs_ddp(given, p, at) -> list[Issue]:
    issues = []
    if p["tensor_parallel_degree"] > 1 and not p["ddp"]:
        issues.append(
            Issue(
                at("tensor_parallel_degree"),
                f"tensor_parallel_degree({p['tensor_parallel_degree']}) > 1 requires ddp: true",
                given=p["tensor_parallel_degree"],
                hint="set `ddp: true`",
            )
        )
    if p["shard_optimizer_state"] and not p["ddp"]:
        issues.append(
            Issue(
                at("shard_optimizer_state"),
                "shard_optimizer_state: true requires ddp: true",
                given=True,
                hint="set `ddp: true`",
            )
        )
    if p["ddp_port"] is not None and not p["ddp"]:
        issues.append(
            Issue(
                at("ddp_port"),
                "ddp_port requires ddp: true",
                given=p["ddp_port"],
                hint="set `ddp: true` or remove `ddp_port`",
            )
        )
    if "ddp_dist_backend" in given and "ddp" not in given:
        # The SDK's rule (validate_mp_config): the `ddp` key must be present alongside it.
        issues.append(
            Issue(
                at("ddp_dist_backend"),
                "ddp_dist_backend requires the `ddp` key",
                given=given["ddp_dist_backend"],
                hint="set `ddp: true` or remove `ddp_dist_backend`",
            )
        )
    return issues


def _exclusive(given, p, at) -> list[Issue]:
    issues = []
    if p["ddp"] and p["horovod"]:
        issues.append(
            Issue(
                at("horovod"),
                "ddp and horovod cannot both be true",
                given=True,
                hint="PyTorch uses `ddp`; `horovod` is for TensorFlow: remove `horovod`",
            )
        )
    if p["herring"] and (p["ddp"] or p["horovod"]):
        issues.append(
            Issue(
                at("herring"),
                "herring: true requires ddp: false and horovod: false",
                given=True,
                hint="remove `herring` (internal, not functional in SMP)",
            )
        )
    if p["bf16"]:
        for other in ("fp16", "fp16_params"):
            if p[other]:
                issues.append(
                    Issue(
                        at("bf16"),
                        f"bf16: true cannot be combined with {other}: true",
                        given=True,
                        hint=f"choose one precision: remove `{other}` or `bf16`",
                    )
                )
    return issues


def _partitioning(given, p, at) -> list[Issue]:
    issues = []
    pp = p["pipeline_parallel_degree"]
    if p["auto_partition"] is False and p["default_partition"] is None:
        issues.append(
            Issue(
                at("auto_partition"),
                "auto_partition: false requires default_partition",
                given=False,
                allowed=f"default_partition in 0..{pp - 1}",
                hint="add `default_partition: 0` (the partition for modules outside smp.partition)",
            )
        )
    dp_ = p["default_partition"]
    if dp_ is not None and dp_ >= pp:
        issues.append(
            Issue(
                at("default_partition"),
                f"default_partition({dp_}) must be < pipeline_parallel_degree({pp})",
                given=dp_,
                allowed=f"0..{pp - 1}",
            )
        )
    return issues


def _microbatches(given, p, at) -> list[Issue]:
    if "active_microbatches" in given and p["active_microbatches"] > p["microbatches"]:
        return [
            Issue(
                at("active_microbatches"),
                f"active_microbatches({p['active_microbatches']}) must be <= microbatches({p['microbatches']})",
                given=p["active_microbatches"],
                allowed=f"1..{p['microbatches']}",
            )
        ]
    return []


def _speed_and_precision(given, p, at) -> list[Issue]:
    issues = []
    if p["prescaled_batch"] and p["optimize"] != "speed":
        issues.append(
            Issue(
                at("prescaled_batch"),
                f'prescaled_batch: true requires optimize: "speed" (given optimize: {_show(p["optimize"])})',
                given=True,
                hint='set `optimize: "speed"` or remove `prescaled_batch`',
            )
        )
    if p["_fp32_grad_accumulation"] and not (p["fp16"] or p["fp16_params"]):
        issues.append(
            Issue(
                at("_fp32_grad_accumulation"),
                "_fp32_grad_accumulation: true requires fp16: true or fp16_params: true",
                given=True,
                hint="set `fp16: true` or remove `_fp32_grad_accumulation`",
            )
        )
    for key in ("_fp32_grad_accumulation", "shard_optimizer_state"):
        if p[key] and not p["overlapping_allreduce"]:
            issues.append(
                Issue(
                    at(key),
                    f"{key}: true requires overlapping_allreduce: true",
                    given=True,
                    hint="remove `overlapping_allreduce: false`",
                )
            )
    return issues


def _sharded(given, p, at) -> list[Issue]:
    sdp = p["sharded_data_parallel_degree"]
    if sdp <= 1:
        return []
    issues = []
    if p["pipeline_parallel_degree"] > 1:
        issues.append(
            Issue(
                at("sharded_data_parallel_degree"),
                f"sharded_data_parallel_degree({sdp}) > 1 cannot be combined with "
                f"pipeline_parallel_degree({p['pipeline_parallel_degree']}) > 1",
                given=sdp,
                hint="set `pipeline_parallel_degree: 1` (or `partitions: 1`)",
            )
        )
    if p["shard_optimizer_state"]:
        issues.append(
            Issue(
                at("sharded_data_parallel_degree"),
                f"sharded_data_parallel_degree({sdp}) > 1 cannot be combined with shard_optimizer_state: true",
                given=sdp,
                hint="remove `shard_optimizer_state`: sharded data parallelism already "
                "shards the optimizer state",
            )
        )
    # SDP + tensor parallelism is allowed (SMP 1.15 release notes); no further rule is documented.
    return issues


V1_RULES: tuple[Rule, ...] = (
    _alias_conflict,
    _needs_ddp,
    _exclusive,
    _partitioning,
    _microbatches,
    _speed_and_precision,
    _sharded,
)


def check_v1(doc: Document, given: Mapping[str, Any], params: Mapping[str, Any]) -> list[Issue]:
    """Cross-key rules over SMP v1 parameters.

    ``given`` holds the schema-valid keys as the user spelled them (aliases included), ``params``
    the resolved canonical values. Pointers name the user's spelling of each key.
    """

    def at(key: str) -> str:
        spelled = key
        if key not in given:
            for alias, canonical in ALIASES.items():
                if canonical == key and alias in given:
                    spelled = alias
        return doc.pointer(spelled)

    issues: list[Issue] = []
    for rule in V1_RULES:
        issues.extend(rule(given, params, at))
    return issues


def check_v2(doc: Document, given: Mapping[str, Any], params: Mapping[str, Any]) -> list[Issue]:
    """SMP v2 rules without a world size: context parallelism fits inside the shard group."""
    hsd, cp = params["hybrid_shard_degree"], params["context_parallel_degree"]
    if "context_parallel_degree" in given and hsd >= 1 and cp > hsd:
        return [
            Issue(
                doc.pointer("context_parallel_degree"),
                f"context_parallel_degree({cp}) must be <= hybrid_shard_degree({hsd})",
                given=cp,
                allowed=f"1..{hsd}",
                hint="raise `hybrid_shard_degree` or lower the context degree",
            )
        ]
    return []


def check_distribution(doc: Document) -> list[Issue]:
    """Launcher/strategy rules of the estimator `distribution` dict (SageMaker SDK behaviour)."""
    dist = doc.distribution
    if not isinstance(dist, Mapping):
        return []
    issues: list[Issue] = []
    smd = dist.get("smdistributed")
    mpi = dist.get("mpi")
    mpi_on = isinstance(mpi, Mapping) and mpi.get("enabled") is True
    for name in ("modelparallel", "dataparallel"):
        block = smd.get(name) if isinstance(smd, Mapping) else None
        if isinstance(block, Mapping) and block.get("enabled") is False:
            issues.append(
                Issue(
                    doc.dist_pointer("smdistributed", name, "enabled"),
                    f"`smdistributed.{name}` is disabled (enabled: false): there is nothing to translate",
                    given=False,
                    hint="set `enabled: true`",
                )
            )
    if doc.strategy == "modelparallel" and doc.smp_version == 1 and not mpi_on:
        where = ("mpi", "enabled") if isinstance(mpi, Mapping) else ("mpi",)
        shown = {"given": mpi["enabled"]} if isinstance(mpi, Mapping) and "enabled" in mpi else {}
        issues.append(
            Issue(
                doc.dist_pointer(*where),
                "SMP v1 (`smdistributed.modelparallel`) runs under MPI: `mpi.enabled` must be true",
                **shown,
                hint='add "mpi": {"enabled": true, "processes_per_host": <GPUs per instance>}, '
                "or enable `torch_distributed` for SMP v2",
            )
        )
    if doc.smp_version == 2 and mpi_on:
        issues.append(
            Issue(
                doc.dist_pointer("mpi", "enabled"),
                "SMP v2 launches with `torch_distributed`; `mpi` cannot be enabled as well",
                given=True,
                hint="remove the `mpi` block",
            )
        )
    launchers = [
        k
        for k in ("mpi", "torch_distributed", "pytorchddp")
        if isinstance(dist.get(k), Mapping) and dist[k].get("enabled") is True
    ]
    if not isinstance(smd, Mapping) and not launchers:
        issues.append(
            Issue(
                doc.dist_pointer(),
                "the distribution enables no strategy or launcher",
                given=dist,
                allowed="smdistributed.modelparallel (SMP) or smdistributed.dataparallel",
                hint='add "smdistributed": {"modelparallel": {"enabled": true, "parameters": {...}}}',
            )
        )
    return issues
