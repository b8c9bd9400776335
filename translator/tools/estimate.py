"""Per-rank model-state memory and communication volume per optimizer step, by formula.

The formulas are docs/internals.md#cost-model (a standard ring alpha-beta model, derived, not
measured): Psi parameters; M = bytes of one copy of the parameters a rank's data-parallel group
handles (Psi / (pp*tp) parameters x 2 bytes for fp16/bf16, 4 for fp32); s = micro-batches per
optimizer step; a ring all-gather or reduce-scatter over g ranks moves (g-1)/g x M per rank, an
all-reduce 2(g-1)/g x M. Model-state bytes per parameter are ``translator/model_state_bytes.py``'s, the ones the
memory estimate uses: 20 for 16-bit DDP (fp32 master and gradients besides Adam's moments), 16 for fp32 DDP,
2w + 16/N under ZeRO-1, (2w + 16)/N under ZeRO-3.

* DDP (ZeRO-0): everything replicated; one gradient all-reduce per step.
* ZeRO-1 (shard_optimizer_state): optimizer state / N; reduce-scatter + all-gather per step.
* ZeRO-3 over all N data-parallel ranks: all / N; per micro-batch all-gather (forward),
  all-gather (backward), reduce-scatter: 3s(N-1)/N x M.
* MiCS (S = shard size, R = N/S): all / S; 3s(S-1)/S x M inside the shard group plus one
  all-reduce of the M/S partition across the replica group, 2(R-1)/R x M/S. With a hierarchical
  all-gather (a shard group over k nodes of n ranks) the parameter gather is an inter-node stage
  ((k-1) x M/S per rank) then an intra-node stage ((n-1)/n x M).

``cross_node_bytes_per_rank`` adds the traffic of every collective whose group spans nodes: an
upper bound, exact when each member of such a group sits on its own node (replica groups with
S = ranks per node, the inter-node gather stage). Tensor/pipeline-parallel traffic (activations)
is not included: it depends on the model, not on the parameter count.
"""

from __future__ import annotations

from typing import Any

from ..model_state_bytes import model_state_bytes_per_parameter
from ..plan_types import Layout, Plan, SMPConfig
from ..topology import Topology


def estimate(
    plan_or_config: Plan | SMPConfig, n_params: float, *, layout: Layout | None = None
) -> dict[str, Any]:
    """Memory and communication figures for the plan's layout and ``n_params`` parameters.

    Accepts a Plan, or an SMPConfig plus ``layout`` (planned here). Returns a JSON-ready dict with
    one entry per scheme (``ddp``, ``zero1``, ``zero3``, and ``mics`` when S > 1) and the scheme
    the plan selected.
    """
    if n_params <= 0:
        raise ValueError(f"n_params must be positive, got {n_params!r}")
    if isinstance(plan_or_config, SMPConfig):
        from ..planner import plan as make_plan  # deferred: the planner imports many modules

        plan_or_config = make_plan(plan_or_config, layout)
    given, settings = plan_or_config.topology_settings, plan_or_config.engine_settings
    topo = Topology(pp=given.pipeline_parallel_degree, tp=given.tensor_parallel_degree, rdp=given.rdp_degree,
                    placement=given.placement)
    rpn = given.ranks_per_node
    shard = given.sharded_data_parallel_degree
    steps = settings.microbatches
    width = 4 if settings.precision.dtype == "fp32" else 2
    per_slice = float(n_params) / (topo.pp * topo.tp)
    copy = per_slice * width
    n = topo.rdp

    def states_at(stage: int, over: int) -> float:
        return per_slice * model_state_bytes_per_parameter(width=width, zero_stage=stage, shard=over)

    states = states_at(0, 1)
    rdp_spans = _spans(topo.groups("rdp")[0], rpn)
    schemes: dict[str, Any] = {
        "ddp": _scheme(
            states, states, [_hop("gradient all-reduce", "all_reduce", n, 1, 2 * _ring(n) * copy, rdp_spans)]
        ),
        "zero1": _scheme(
            states,
            states_at(1, n),
            [
                _hop("gradient reduce-scatter", "reduce_scatter", n, 1, _ring(n) * copy, rdp_spans),
                _hop("parameter all-gather", "all_gather", n, 1, _ring(n) * copy, rdp_spans),
            ],
        ),
        "zero3": _scheme(states, states_at(3, n), _sharded_hops(n, steps, copy, rdp_spans)),
    }
    if shard > 1:
        schemes["mics"] = _mics(topo, shard, rpn, steps, copy, states, states_at(3, shard),
                                bool(_hierarchical(plan_or_config)))
    selected = "mics" if shard > 1 else {0: "ddp", 1: "zero1"}.get(settings.zero_stage, "zero3")
    return {
        "n_params": float(n_params),
        "bytes_per_param_copy": width,
        "gradient_accumulation_steps": steps,
        "data_parallel_size": n,
        "shard_size": shard,
        "ranks_per_node": rpn,
        "model_states_bytes_unsharded": states,
        "selected": selected,
        "schemes": schemes,
        "assumptions": [
            "Adam under DeepSpeed: 20 bytes of model state per parameter in 16-bit DDP, 16 in fp32 (fp32 master and "
            "gradients), sharded by ZeRO; activations and buffers not included",
            "ring collectives; cross-node bytes count every collective whose group spans nodes (upper bound)",
            "tensor/pipeline parallelism divides the parameters evenly; its activation traffic is excluded",
        ],
    }


def _ring(group: int) -> float:
    return (group - 1) / group if group > 1 else 0.0


def _spans(group: list[int], rpn: int) -> bool:
    return len({rank // rpn for rank in group}) > 1


def _hop(name: str, collective: str, group: int, per_step: int, volume: float, spans: bool) -> dict[str, Any]:
    return {
        "name": name,
        "collective": collective,
        "group_size": group,
        "times_per_step": per_step,
        "bytes_per_rank": volume * per_step,
        "ring_steps": (group - 1) * per_step,
        "spans_nodes": spans,
    }


def _scheme(unsharded: float, per_rank: float, hops: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "memory_bytes_per_rank": per_rank,
        "memory_fraction": per_rank / unsharded,
        "hops": hops,
        "bytes_per_rank": sum(h["bytes_per_rank"] for h in hops),
        "cross_node_bytes_per_rank": sum(h["bytes_per_rank"] for h in hops if h["spans_nodes"]),
    }


def _sharded_hops(group: int, steps: int, copy: float, spans: bool) -> list[dict[str, Any]]:
    return [
        _hop("parameter all-gather (forward)", "all_gather", group, steps, _ring(group) * copy, spans),
        _hop("parameter all-gather (backward)", "all_gather", group, steps, _ring(group) * copy, spans),
        _hop("gradient reduce-scatter", "reduce_scatter", group, steps, _ring(group) * copy, spans),
    ]


def _hierarchical(plan: Plan) -> bool:
    return plan.engine_settings.mics.hierarchical_allgather


def _mics(
    topo: Topology, shard: int, rpn: int, steps: int, copy: float, states: float, sharded_states: float,
    hierarchical: bool
) -> dict[str, Any]:
    shard_group = topo.shard_groups(shard)[0]
    replica_group = topo.replica_groups(shard)[0]
    replicas = len(replica_group)
    nodes_in_shard = len({rank // rpn for rank in shard_group})
    shard_spans = nodes_in_shard > 1
    if hierarchical and shard_spans:
        local = shard // nodes_in_shard
        hops = []
        for phase in ("forward", "backward"):
            hops.append(
                _hop(
                    f"parameter all-gather ({phase}), inter-node stage",
                    "all_gather",
                    nodes_in_shard,
                    steps,
                    (nodes_in_shard - 1) * copy / shard,
                    True,
                )
            )
            hops.append(
                _hop(
                    f"parameter all-gather ({phase}), intra-node stage",
                    "all_gather",
                    local,
                    steps,
                    _ring(local) * copy,
                    False,
                )
            )
        hops.append(
            _hop("gradient reduce-scatter", "reduce_scatter", shard, steps, _ring(shard) * copy, True)
        )
    else:
        hops = _sharded_hops(shard, steps, copy, shard_spans)
    hops.append(
        _hop(
            "replica all-reduce of the gradient partition",
            "all_reduce",
            replicas,
            1,
            2 * _ring(replicas) * copy / shard,
            _spans(replica_group, rpn),
        )
    )
    out = _scheme(states, sharded_states, hops)
    out["replicas"] = replicas
    out["nodes_per_shard_group"] = nodes_in_shard
    out["hierarchical_allgather"] = hierarchical and shard_spans
    return out
