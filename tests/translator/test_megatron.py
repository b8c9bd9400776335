"""Megatron output: rank order checked against DeepSpeed's ProcessTopology and Megatron-Core's
RankGenerator (both pure rank arithmetic), ModelParallelConfig acceptance, CLI arguments."""

from __future__ import annotations

import pytest

from smp2ds.translator.megatron import deepspeed_axes, megatron_order, same_order
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout
from smp2ds.translator.planner import plan
from smp2ds.translator.topology import PLACEMENT_ORDERS, Topology

SIZES = [(2, 2, 2), (2, 1, 3), (1, 2, 3), (3, 2, 1)]  # (pp, tp, rdp)


def make(params, world, batch=None, gpus=None):
    layout = Layout(world_size=world, batch_size=batch, gpus_per_node=gpus)
    return plan(normalize(params, layout), layout)


def as_sets(groups):
    return sorted(sorted(g) for g in groups)


def test_order_table_of_mapping_anchors():
    expected = {
        "PDT": "tp-dp-pp",
        "DPT": "tp-pp-dp",
        "TPD": "dp-pp-tp",
        "PTD": "dp-tp-pp",
        "DTP": "pp-tp-dp",
        "TDP": "pp-dp-tp",
    }
    assert {letters: megatron_order(letters) for letters in PLACEMENT_ORDERS} == expected
    assert deepspeed_axes("DPT") == ["data", "pipe", "model"]


@pytest.mark.parametrize("letters", PLACEMENT_ORDERS)
@pytest.mark.parametrize("pp, tp, rdp", SIZES)
def test_deepspeed_process_topology_builds_the_same_groups(letters, pp, tp, rdp):
    topology_mod = pytest.importorskip("deepspeed.runtime.pipe.topology")
    ours = Topology(pp=pp, tp=tp, rdp=rdp, placement=letters)
    dims = {"P": pp, "T": tp, "D": rdp}
    theirs = topology_mod.ProcessTopology(axes=deepspeed_axes(letters), dims=[dims[c] for c in letters])
    for axis, kind in (("model", "tp"), ("pipe", "pp"), ("data", "rdp")):
        assert as_sets(theirs.get_axis_comm_lists(axis)) == as_sets(ours.groups(kind)), (axis, kind)


@pytest.mark.parametrize("letters", PLACEMENT_ORDERS)
@pytest.mark.parametrize("pp, tp, rdp", SIZES)
def test_megatron_rank_generator_builds_the_same_groups(letters, pp, tp, rdp):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    ours = Topology(pp=pp, tp=tp, rdp=rdp, placement=letters)
    gen = parallel_state.RankGenerator(tp=tp, ep=1, dp=rdp, pp=pp, cp=1, order=megatron_order(letters))
    for token, kind in (("tp", "tp"), ("pp", "pp"), ("dp", "rdp"), ("tp-pp", "mp")):
        assert as_sets(gen.get_ranks(token)) == as_sets(ours.groups(kind)), token


@pytest.mark.parametrize(
    "params, world",
    [
        ({"ddp": True, "fp16": True}, 2),
        ({"partitions": 2, "tensor_parallel_degree": 2, "ddp": True, "bf16": True}, 8),
        ({"partitions": 2, "ddp": True}, 2),
    ],
)
def test_model_parallel_config_is_accepted_by_megatron_core(params, world):
    torch = pytest.importorskip("torch")
    megatron_core = pytest.importorskip("megatron.core")
    fields = dict(make(params, world).megatron["model_parallel_config"])
    for name in ("params_dtype", "pipeline_dtype"):
        fields[name] = getattr(torch, fields[name].removeprefix("torch."))
    cfg = megatron_core.ModelParallelConfig(**fields)
    assert cfg.tensor_model_parallel_size == params.get("tensor_parallel_degree", 1)
    assert cfg.pipeline_model_parallel_size == params.get("partitions", 1)


def test_same_order_ignores_axes_of_size_one():
    assert same_order("dp-pp-tp", "tp-dp-pp", {"tp": 1, "pp": 2, "dp": 4})  # spread, no TP = Megatron default
    assert not same_order("tp-pp-dp", "tp-dp-pp", {"tp": 1, "pp": 2, "dp": 4})
    assert same_order("tp-pp-dp", "tp-dp-pp", {"tp": 2, "pp": 1, "dp": 4})


def test_cluster_with_pipeline_needs_the_tp_pp_dp_mapping():
    meg = make({"partitions": 2, "ddp": True, "microbatches": 4}, 8, batch=8).megatron
    assert meg["rank_order"] == "tp-pp-dp" and meg["use_tp_pp_dp_mapping"]
    assert "--use-tp-pp-dp-mapping" in meg["megatron_lm_args"]
    args = meg["megatron_lm_args"]
    # Megatron: global = micro x num_microbatches x DP (DP = rdp = 4)
    assert args[args.index("--micro-batch-size") + 1] == "2"
    assert args[args.index("--global-batch-size") + 1] == str(2 * 4 * 4)
    assert meg["deepspeed_topology"] == {"axes": ["data", "pipe", "model"], "dims": [4, 2, 1]}


def test_plain_data_parallel_needs_no_order_flag_and_no_pipeline_in_megatron_deepspeed():
    meg = make({"ddp": True}, 4).megatron
    assert "--use-tp-pp-dp-mapping" not in meg["megatron_lm_args"]
    assert "--no-pipeline-parallel" in meg["megatron_deepspeed_args"]
    assert "--micro-batch-size" not in meg["megatron_lm_args"]  # batch unknown


def test_fp16_sdp_and_offload_arguments():
    p = make(
        {"ddp": True, "fp16": True, "sharded_data_parallel_degree": 2, "offload_activations": True}, 8, gpus=4
    )
    lm, mds = p.megatron["megatron_lm_args"], p.megatron["megatron_deepspeed_args"]
    assert lm[lm.index("--initial-loss-scale") + 1] == str(2**32)
    assert lm[lm.index("--hysteresis") + 1] == "1"
    assert lm[lm.index("--clip-grad") + 1] == "1.0"
    assert lm[lm.index("--num-distributed-optimizer-instances") + 1] == "4"
    assert mds[mds.index("--zero-stage") + 1] == "3"
    assert "--checkpoint-in-cpu" in mds
    assert any("parameters and gradients stay replicated" in r for r in p.remarks)


def test_orders_megatron_lm_cannot_express_are_reported():
    p = make({"partitions": 2, "tensor_parallel_degree": 2, "ddp": True, "placement_strategy": "spread"}, 8)
    assert p.megatron["rank_order"] == "dp-pp-tp"
    assert any("initialize_model_parallel(order='dp-pp-tp')" in r for r in p.remarks)
