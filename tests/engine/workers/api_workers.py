"""Rank body exercising the smp.* API surface on 2 ranks (errors, hooks, ranks, collectives)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch


def _raises(fn: Any, exc: type) -> str:
    try:
        fn()
    except exc as err:
        return str(err)
    except Exception as err:  # noqa: BLE001
        return f"WRONG {type(err).__name__}: {err}"
    return "NO ERROR"


def api_checks(tmp: str) -> dict:
    import smdistributed.modelparallel.torch as smp
    from smdistributed.modelparallel.torch import exceptions as E

    out: dict[str, Any] = {}
    smp.init({"ddp": True, "microbatches": 2, "placement_strategy": "spread"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        smp.init({"ddp": True})
    out["second_init_warns"] = any("already called" in str(w.message) for w in caught)
    r = smp.rank()
    out["ranks"] = (r, smp.size(), smp.local_rank(), smp.local_size(), smp.dp_rank(), smp.dp_size(), smp.pp_rank(),
                    smp.pp_size(), smp.tp_rank(), smp.tp_size(), smp.mp_rank(), smp.mp_size(), smp.rdp_rank(),
                    smp.rdp_size(), smp.num_microbatches())
    out["groups"] = (smp.get_dp_group(), smp.get_mp_group(), smp.get_pp_group(), smp.get_tp_group(), smp.get_rdp_group())
    out["pg"] = smp.get_dp_process_group() is not None and smp.get_world_process_group() is not None
    out["cfg"] = (smp.state.cfg.microbatches, smp.state.cfg.fp16, smp.state.cfg.prescaled_batch,
                  smp.state.cfg.shard_optimizer_state, smp.state.cfg.placement_strategy, smp.state.cfg.zero2d_enabled())
    out["mpu"] = (smp.state.get_data_parallel_rank(), smp.state.get_data_parallel_world_size(),
                  smp.state.get_model_parallel_world_size())
    # collectives: SMP's asymmetric broadcast, send/recv, allgather order, gather, invalid group
    if r == 0:
        smp.broadcast({"hello": torch.arange(3)}, smp.CommGroup.WORLD)
        smp.send("to one", 1, smp.RankType.DP_RANK)
        out["recv"] = smp.recv_from(1, smp.RankType.WORLD_RANK)
    else:
        out["recv"] = smp.recv_from(0, smp.RankType.WORLD_RANK)["hello"].tolist()
        out["recv2"] = smp.recv_from(0, smp.RankType.DP_RANK)
        smp.send(("back", 1), 0, smp.RankType.WORLD_RANK)
    out["allgather"] = smp.allgather(r * 10, smp.DP_GROUP)
    out["gather"] = smp.gather(r, smp.WORLD)
    out["bad_group"] = _raises(lambda: smp.barrier(17), E.InvalidCommGroupError)
    smp.dp_barrier()
    # step/model/optimizer misuse
    out["step_before_model"] = _raises(lambda: smp.step(lambda m: None)(None), E.DistributedModelNotWrappedError)
    out["opt_before_model"] = _raises(lambda: smp.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)),
                                      E.DistributedModelNotWrappedError)
    out["unknown_arg"] = _raises(lambda: smp.DistributedModel(torch.nn.Linear(2, 2), trace_devise="gpu"),
                                 E.SMPInvalidArgumentError)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)),
                                     bucket_cap_mb=50, broadcast_buffers=True)
    out["explained"] = sorted(model.ignored_arguments)
    out["explained_warned"] = sum("has no effect on smp2ds" in str(w.message) for w in caught)
    out["second_model"] = _raises(lambda: smp.DistributedModel(torch.nn.Linear(2, 2)), E.MultipleDistributedModelError)
    out["foreign"] = _raises(lambda: smp.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)),
                             E.SMPInvalidArgumentError)
    calls: list[str] = []
    model.register_post_partition_hook(lambda m, o: calls.append("partition"))
    model.register_post_step_hook(lambda m, o: calls.append("step"))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    out["backward_outside"] = _raises(lambda: model.backward(model(torch.ones(2, 4)).sum()), E.BwdExecutionNotInStepFnError)

    @smp.step
    def train_step(model, x):
        loss = model(x).pow(2).mean()
        model.backward(loss)
        return loss

    out["not_divisible"] = _raises(lambda: train_step(model, torch.ones(3, 4)), E.TensorSplitError)
    for _ in range(2):
        opt.zero_grad()
        train_step(model, torch.ones(4, 4) * (r + 1))
        opt.step()
    out["hooks"] = list(calls)
    model.register_post_step_hook(lambda m, o: calls.append("late"))  # already stepped: runs at once
    out["late_hook"] = calls[-1]
    out["names"] = [n for n, _ in model.named_parameters()] == [n for n, _ in model.local_named_parameters()]
    out["sd_keys"] = sorted(model.state_dict())
    out["local_keys"] = sorted(model.local_state_dict())
    out["is_module_eval"] = (model.eval().module.training, model.train().module.training)
    # activation checkpointing changes memory, not maths
    x = torch.randn(4, 4)
    ref_grad = torch.autograd.grad(model.get_module()(x).sum(), list(model.parameters()))
    smp.set_activation_checkpointing(model.get_module()[0])
    ckpt_grad = torch.autograd.grad(model.get_module()(x).sum(), list(model.parameters()))
    out["ckpt_equal"] = all(torch.allclose(a, b) for a, b in zip(ref_grad, ckpt_grad))
    out["ckpt_fn"] = torch.allclose(smp.checkpoint(model.get_module()[2], torch.ones(1, 4)), model.get_module()[2](torch.ones(1, 4)))
    # smp.save/smp.load: per-rank names found from the same prefix; missing parts are an error
    smp.save({"r": r}, os.path.join(tmp, "obj"), partial=True)
    smp.barrier()
    out["load_own"] = smp.load(os.path.join(tmp, "obj"), partial=True)  # pp=tp=0 for both: same file name
    smp.save({"r": r}, os.path.join(tmp, "objv3"), partial=True, v3=True)
    smp.barrier()
    out["load_v3"] = smp.load(os.path.join(tmp, "objv3"), partial=True)
    smp.barrier()
    if r == 0:
        os.remove(os.path.join(tmp, "objv3_0_0_1.pt"))
    smp.barrier()
    out["missing"] = _raises(lambda: smp.load(os.path.join(tmp, "objv3"), partial=True), E.MissingCheckpointFilesError)
    out["nn"] = tuple(smp.nn.DistributedLinear(3, 5).weight.shape)
    out["nn_unsupported"] = _raises(lambda: smp.nn.FlashAttentionLayer(use_alibi=True), E.SMPUnsupportedError)
    smp.barrier()
    return out


def group_checks(config: dict) -> dict:
    """Every SMP group: allgather order and a real all-reduce over the torch process group."""
    import torch.distributed as dist

    import smdistributed.modelparallel.torch as smp
    from smp2ds.translator.topology import Topology

    smp.init(config)
    topo = Topology.for_world(smp.size(), pp=smp.pp_size(), tp=smp.tp_size(), placement=config["placement_strategy"])
    out: dict[str, Any] = {"coords": (smp.pp_rank(), smp.tp_rank(), smp.rdp_rank(), smp.dp_rank(), smp.mp_rank())}
    expected = topo.coords(smp.rank())
    out["coords_ok"] = out["coords"] == (expected.pp_rank, expected.tp_rank, expected.rdp_rank, expected.dp_rank,
                                         expected.mp_rank)
    getters = {"pp": (smp.PP_GROUP, smp.get_pp_process_group, smp.get_pp_group),
               "rdp": (smp.RDP_GROUP, smp.get_rdp_process_group, smp.get_rdp_group),
               "dp": (smp.DP_GROUP, smp.get_dp_process_group, smp.get_dp_group),
               "mp": (smp.MP_GROUP, smp.get_mp_process_group, smp.get_mp_group),
               "tp": (smp.TP_GROUP, smp.get_tp_process_group, smp.get_tp_group)}
    for kind, (group, pg, lister) in getters.items():
        t = torch.tensor([float(smp.rank())])
        dist.all_reduce(t, group=pg())
        members = topo.group_of(kind, smp.rank())
        out[kind] = {"allgather": smp.allgather(smp.rank(), group), "members": members, "lister": lister(),
                     "sum": t.item(), "expected_sum": float(sum(members))}
    smp.barrier()
    return out


def wrapper_chain_checks(config: dict) -> dict:
    """The classes from ``DistributedModel`` down ``.module`` to the user's model, whether the first one is a torch
    ``DistributedDataParallel``, what a wrapper reads from the model and returns when called, and the names."""
    from torch.nn.parallel import DistributedDataParallel

    import smdistributed.modelparallel.torch as smp

    smp.init(config)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    net.custom = 7
    model = smp.DistributedModel(net)
    chain, current = [], model.module
    while current is not net:
        chain.append(type(current).__name__)
        current = current.module
    x = torch.ones(1, 4)
    return {"chain": chain, "ddp_instance": isinstance(model.module, DistributedDataParallel),
            "custom": model.module.custom, "get_module": model.get_module() is net,
            "same_call": torch.equal(model.module(x), net(x)) if smp.pp_size() == 1 else None,
            "names": sorted(n for n, _ in model.named_parameters()), "modules": len(list(model.modules()))}
