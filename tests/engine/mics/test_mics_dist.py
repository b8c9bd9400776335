"""MiCS sharded data parallelism with real processes (gloo, CPU): equivalence, memory, communication.

Two spawns of 4 ranks, each running several trainings back to back (a spawn costs ~6 s of
imports). Every final weight is compared with a single-process plain-PyTorch run on the union of
the four ranks' data (Adam, fp32, rtol 1e-4).

* spawn 1: S = 1, 2, 4 x accumulation 1, 2 (clipping active with accumulation 2); partition
  sizes; S=2 with 4 micro-batches under the communication counter; save -> resume; bf16.
* spawn 2 (2 simulated nodes x 2 ranks): hierarchical all-gather on/off for S=4 (bit-identical,
  and only node-local / cross-node sub-groups used); auto-off for S=2; the gather primitive
  itself; parameters created partitioned (``mics_init_context``), also for a Hugging Face model.
"""

from __future__ import annotations

import os

import pytest

from tests._dist import run_ranks

WORLD = 4
STEPS = 3
MICRO = 2  # samples per micro-batch per rank
IN, HID, OUT = 8, 16, 4  # every weight/bias numel divides 4, so partitions carry no padding
LR = 0.01


def _model(reinit: bool = False):
    import torch

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
    if reinit:  # a user init function applied after construction (under zero.Init: gathered, re-broadcast)
        torch.manual_seed(5)
        model.apply(_reinit)
    return model


def _reinit(module) -> None:
    import torch

    if isinstance(module, torch.nn.Linear):
        torch.nn.init.normal_(module.weight, std=0.3)
        torch.nn.init.uniform_(module.bias, -0.1, 0.1)


def _data(steps: int, gas: int):
    """Inputs/targets of shape (steps, WORLD, gas, MICRO, features): one slice per rank and micro-batch."""
    import torch

    g = torch.Generator().manual_seed(99)
    x = torch.randn(steps, WORLD, gas, MICRO, IN, generator=g)
    y = torch.randn(steps, WORLD, gas, MICRO, OUT, generator=g)
    return x, y


def _ds_config(gas: int, clip: float, bf16: bool = False) -> dict:
    # What the planner emits for sharded_data_parallel_degree > 1 (stage 3 + sdp_* keys); the
    # persistence threshold is 0 so that these tiny tensors are partitioned, not kept whole.
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "train_batch_size": MICRO * gas * WORLD,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 500_000_000,
                              "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1_000_000_000},
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,  # SMP wraps any torch optimizer (SGD below)
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _optimizer(params, kind: str = "adam"):
    import torch

    return torch.optim.Adam(params, lr=LR) if kind == "adam" else torch.optim.SGD(params, lr=0.5)


def reference(steps: int, gas: int, clip: float, opt_kind: str = "adam",
              reinit: bool = False) -> tuple[dict, list[float]]:
    """Plain PyTorch on one process over the union of every rank's micro-batches."""
    import torch

    model = _model(reinit)
    opt = _optimizer(model.parameters(), opt_kind)
    x, y = _data(steps, gas)
    norms = []
    for s in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[s].reshape(-1, IN)), y[s].reshape(-1, OUT))
        loss.backward()
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


# ---------------------------------------------------------------------------------- rank side
def _init_dist():
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=os.environ["SMP2DS_INIT_METHOD"],
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    deepspeed.init_distributed(dist_backend="gloo")


def _engine(shard: int, gas: int, clip: float, *, bf16: bool = False, ranks_per_node=None,
            hierarchical: bool = True, delayed: bool = False, opt_kind: str = "adam"):

    from smp2ds.engine import mics
    from smp2ds.translator.topology import Topology

    groups = mics.MicsGroups.create(Topology(rdp=WORLD), shard, ranks_per_node=ranks_per_node,
                                    hierarchical=hierarchical)
    cfg = _ds_config(gas, clip, bf16)
    if delayed:
        with mics.mics_init_context(cfg, groups):
            model = _model(reinit=True)
        assert all(hasattr(p, "ds_tensor") and p.ds_tensor.numel() == p.ds_numel // shard
                   for p in model.parameters()), "parameters were not born partitioned"
    else:
        model = _model()
    engine, _ = mics.initialize(model, _optimizer(model.parameters(), opt_kind), cfg, groups)
    return engine, groups


def _run_steps(engine, gas: int, steps: range, total_steps: int, *, bf16: bool = False, counter=None) -> list:
    import torch

    rank = int(os.environ["RANK"])
    x, y = _data(total_steps, gas)
    losses = []
    for s in steps:
        if counter is not None:
            counter.reset()  # what remains recorded is the last optimizer step
        for m in range(gas):
            xb, yb = x[s, rank, m], y[s, rank, m]
            if bf16:
                xb, yb = xb.bfloat16(), yb.bfloat16()
            loss = torch.nn.functional.mse_loss(engine(xb), yb)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


def _weights(engine) -> dict:
    from smp2ds.engine import mics

    # numpy, not tensors: tensors cross the result queue as shared memory that dies with the worker.
    return {k: v.float().numpy() for k, v in mics.full_state_dict(engine).items()}


def _counter_summary(counter, groups) -> dict:
    shard, replica = groups.layout.shard_ranks, groups.layout.replica_ranks
    return {
        "replica_allreduce": [r.nbytes for r in counter.select("all_reduce", replica)],
        "shard_reduce_scatter": len(counter.select(("reduce_scatter_tensor", "_reduce_scatter_base"), shard)),
        "shard_allgather": len(counter.select(("all_gather_into_tensor", "_all_gather_base"), shard)),
        "ops": sorted({(r.op, r.ranks) for r in counter.records}),
    }


def _spawn1_worker() -> dict:
    from smp2ds.engine import mics
    from smp2ds.engine.diagnostics import comm_counter

    _init_dist()
    out: dict = {}
    for shard in (1, 2, 4):
        for gas, clip in ((1, 0.0), (2, 0.05)):
            engine, groups = _engine(shard, gas, clip)
            _run_steps(engine, gas, range(STEPS), STEPS)
            out[("train", shard, gas, clip)] = {
                "weights": _weights(engine), "stats": mics.partition_stats(engine),
                "syncs": engine.optimizer.mics_replica_syncs, "replicas": groups.replicas,
                "norm": float(engine.get_global_grad_norm()) if clip > 0 else None,
            }
    # S=2, R=2, 4 micro-batches: count collectives of one optimizer step.
    engine, groups = _engine(2, 4, 0.05)
    with comm_counter.CommCounter() as counter:
        _run_steps(engine, 4, range(STEPS), STEPS, counter=counter)
    out["count"] = {"weights": _weights(engine), "stats": mics.partition_stats(engine),
                    **_counter_summary(counter, groups)}
    # Save after 2 of 4 steps, resume in a fresh engine, compare with the uninterrupted run.
    ckpt = os.path.join(os.environ["SMP2DS_TEST_TMPDIR"], "ckpt")
    engine, _ = _engine(2, 2, 0.05)
    _run_steps(engine, 2, range(2), 4)
    engine.save_checkpoint(ckpt, tag="step2")
    _run_steps(engine, 2, range(2, 4), 4)
    uninterrupted = _weights(engine)
    engine, _ = _engine(2, 2, 0.05)
    engine.load_checkpoint(ckpt, tag="step2")
    resumed_at = engine.global_steps
    _run_steps(engine, 2, range(2, 4), 4)
    out["resume"] = {"uninterrupted": uninterrupted, "resumed": _weights(engine), "resumed_at": resumed_at,
                     "files": sorted(os.listdir(os.path.join(ckpt, "step2")))}
    # Full (unpartitioned) state dict into a fresh engine: weights and the fp32 master copy follow.
    import torch

    engine, _ = _engine(2, 2, 0.05)
    mics.load_full_state_dict(engine, {k: torch.from_numpy(v) for k, v in uninterrupted.items()})
    master = torch.cat([t.detach().flatten() for t in engine.optimizer.fp32_partitioned_groups_flat])
    partition = torch.cat([p.ds_tensor.detach().flatten() for p in engine.module.parameters()])
    out["full_load"] = {"weights": _weights(engine), "master_matches": bool(torch.equal(master, partition)),
                        "ds_attrs": all(hasattr(p, a) for p in engine.module.parameters()
                                        for a in ("ds_tensor", "ds_numel", "ds_shape"))}
    # bf16 parameters (fp32 master weights inside DeepSpeed).
    engine, _ = _engine(2, 2, 0.05, bf16=True, opt_kind="sgd")
    out["bf16"] = {"weights": _weights(engine)}
    losses = _run_steps(engine, 2, range(STEPS), STEPS, bf16=True)
    out["bf16"].update(after=_weights(engine), losses=losses, dtype=str(next(engine.module.parameters()).dtype))
    return out


@pytest.fixture(scope="module")
def spawn1() -> list:
    return run_ranks(_spawn1_worker, WORLD)


@pytest.mark.slow
def test_weights_match_single_process_for_s_1_2_4_and_accumulation(spawn1):
    cases = [k for k in spawn1[0] if k[0] == "train"]
    assert len(cases) == 6
    for _, shard, gas, clip in cases:
        ref, ref_norms = reference(STEPS, gas, clip)
        if clip > 0:
            assert min(ref_norms) > clip, (ref_norms, clip)  # the clipping really bites
        for rank, per_rank in enumerate(spawn1):
            got = per_rank[("train", shard, gas, clip)]
            for name, tensor in ref.items():
                assert_close(got["weights"][name], tensor, f"S={shard} gas={gas} clip={clip} rank={rank} {name}")
            if clip > 0:  # DeepSpeed's norm (used for clipping) equals the unsharded norm
                assert abs(got["norm"] - ref_norms[-1]) <= 1e-4 * ref_norms[-1], (got["norm"], ref_norms[-1])
            assert got["syncs"] == (STEPS if got["replicas"] > 1 else 0)


@pytest.mark.slow
def test_each_rank_holds_one_over_s_of_params_grads_and_optimizer_state(spawn1):
    for _, shard, gas, clip in [k for k in spawn1[0] if k[0] == "train"]:
        for per_rank in spawn1:
            stats = per_rank[("train", shard, gas, clip)]["stats"]
            full = stats["param_full_elements"]
            assert full == IN * HID + HID + HID * OUT + OUT
            for key in ("param_elements", "grad_elements", "master_elements"):
                assert stats[key] == full // shard, (shard, key, stats)
            assert stats["optimizer_state_elements"] == 2 * full // shard  # Adam: exp_avg, exp_avg_sq
            assert abs(stats["fraction"] - 1 / shard) < 0.01 / shard, stats


@pytest.mark.slow
def test_replica_allreduce_runs_once_per_optimizer_step_with_four_microbatches(spawn1):
    ref, _ = reference(STEPS, 4, 0.05)
    for rank, per_rank in enumerate(spawn1):
        got = per_rank["count"]
        for name, tensor in ref.items():
            assert_close(got["weights"][name], tensor, f"S=2 gas=4 rank={rank} {name}")
        # One all-reduce over the replica group in the step, of this rank's fp32 gradient partition.
        assert got["replica_allreduce"] == [got["stats"]["grad_elements"] * 4], got
        # Hop 1 stays inside the shard group, every micro-batch.
        assert got["shard_reduce_scatter"] >= 4, got
        assert got["shard_allgather"] >= 4, got
        others = [op for op in got["ops"] if len(op[1]) == WORLD]
        assert others == [], f"collectives over all ranks in a MiCS step: {others}"


@pytest.mark.slow
def test_save_then_resume_equals_uninterrupted_and_full_state_dict_loads(spawn1):
    ref, _ = reference(4, 2, 0.05)
    for rank, per_rank in enumerate(spawn1):
        got = per_rank["resume"]
        assert got["resumed_at"] == 2
        for name in ref:
            assert_close(got["resumed"][name], got["uninterrupted"][name], f"rank={rank} {name}", rtol=1e-6)
            assert_close(got["resumed"][name], ref[name], f"rank={rank} {name} vs reference")
        full = per_rank["full_load"]
        assert full["master_matches"] and full["ds_attrs"]
        for name in ref:
            assert_close(full["weights"][name], got["uninterrupted"][name], f"full load rank={rank} {name}", rtol=0)
    # Only the first shard group wrote: one optimizer-state file per shard rank, not per global rank.
    optim_files = [f for f in spawn1[0]["resume"]["files"] if "optim_states" in f]
    assert len(optim_files) == 2, spawn1[0]["resume"]["files"]


@pytest.mark.slow
def test_bf16_trains_close_to_fp32_reference_and_replicas_agree(spawn1):
    import numpy as np

    ref, _ = reference(STEPS, 2, 0.05, "sgd")
    first = spawn1[0]["bf16"]
    assert first["dtype"] == "torch.bfloat16"
    for rank, per_rank in enumerate(spawn1):
        got = per_rank["bf16"]
        for name in ref:
            # bf16 keeps 8 mantissa bits (~4e-3 relative) in forward/backward: compare with bf16-sized
            # tolerances (SGD: errors stay proportional to the gradient error, unlike Adam's
            # normalised steps), and require the update itself to be well above that noise.
            assert_close(got["after"][name], ref[name], f"bf16 rank={rank} {name}", rtol=1e-2, atol=2e-3)
            assert np.array_equal(got["after"][name], first["after"][name]), f"replicas differ: {name}"
        moved = max(float(np.abs(got["after"][n] - got["weights"][n]).max()) for n in ref)
        assert moved > 0.01, moved


# ---------------------------------------------------------------- spawn 2: two simulated nodes
def _spawn2_worker() -> dict:
    import torch
    import torch.distributed as dist

    from smp2ds.engine import mics
    from smp2ds.engine.diagnostics import comm_counter
    from smp2ds.translator.topology import Topology

    _init_dist()
    out: dict = {}
    # The gather primitive alone, against the flat all-gather, on an odd partition size.
    groups = mics.MicsGroups.create(Topology(rdp=WORLD), 4, ranks_per_node=2)
    part = torch.arange(5, dtype=torch.float32) + 10 * dist.get_rank()
    flat = torch.empty(20)
    dist.all_gather_into_tensor(flat, part, group=groups.shard_group)
    hier = torch.empty(20)
    plan = groups.layout.my_hierarchical
    mics.hierarchical_all_gather(hier, part, groups.inter_group, groups.intra_group, plan.nodes, plan.per_node,
                                 async_op=False)
    out["primitive"] = bool(torch.equal(flat, hier))
    for hierarchical in (True, False):
        engine, groups = _engine(4, 2, 0.05, ranks_per_node=2, hierarchical=hierarchical)
        with comm_counter.CommCounter() as counter:
            _run_steps(engine, 2, range(STEPS), STEPS, counter=counter)
        out[("hier", hierarchical)] = {"weights": _weights(engine), "enabled": groups.hierarchical,
                                       "gathers": sorted({r.ranks for r in counter.records
                                                          if r.op in ("all_gather_into_tensor", "_all_gather_base")})}
        mics.uninstall_hierarchical_allgather()
    groups = mics.MicsGroups.create(Topology(rdp=WORLD), 2, ranks_per_node=2)
    out["s2_plan"] = (groups.hierarchical, groups.layout.my_hierarchical.reason)
    # Parameters born partitioned (delayed_parameter_initialization), S=2.
    engine, _ = _engine(2, 2, 0.05, delayed=True)
    _run_steps(engine, 2, range(STEPS), STEPS)
    out["delayed"] = _weights(engine)
    out["hf"] = _hf_under_init()
    return out


def _hf_under_init() -> dict:
    """A tiny GPT-2 built under mics_init_context: shard group 1 (ranks 2, 3) lacks global rank 0."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from smp2ds.engine import mics
    from smp2ds.translator.topology import Topology

    groups = mics.MicsGroups.create(Topology(rdp=WORLD), 2)
    cfg = _ds_config(1, 1.0)
    torch.manual_seed(7)
    with mics.mics_init_context(cfg, groups):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    engine, _ = mics.initialize(model, torch.optim.Adam(model.parameters(), lr=LR), cfg, groups)
    ids = torch.randint(0, 64, (MICRO, 8), generator=torch.Generator().manual_seed(int(os.environ["RANK"])))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return {k: v.float().numpy() for k, v in mics.full_state_dict(engine).items()}


@pytest.fixture(scope="module")
def spawn2() -> list:
    return run_ranks(_spawn2_worker, WORLD, ranks_per_node=2)


@pytest.mark.slow
def test_hierarchical_allgather_gives_identical_results_on_two_nodes(spawn2):
    import numpy as np

    ref, _ = reference(STEPS, 2, 0.05)
    for rank, per_rank in enumerate(spawn2):
        assert per_rank["primitive"], "hierarchical all-gather bytes differ from the flat all-gather"
        on, off = per_rank[("hier", True)], per_rank[("hier", False)]
        assert on["enabled"] and not off["enabled"]
        for name in ref:
            assert np.array_equal(on["weights"][name], off["weights"][name]), name
            assert_close(on["weights"][name], ref[name], f"hierarchical rank={rank} {name}")
        # Parameter fetches used the inter-node pairs and the node-local pairs, never the 4-rank ring.
        assert (0, 1, 2, 3) not in on["gathers"], on["gathers"]
        assert {(0, 2), (1, 3)} & set(on["gathers"]) and {(0, 1), (2, 3)} & set(on["gathers"]), on["gathers"]
        assert (0, 1, 2, 3) in off["gathers"]
        enabled, reason = per_rank["s2_plan"]
        assert not enabled and "fits in one node" in reason


@pytest.mark.slow
def test_parameters_created_partitioned_train_like_the_reference(spawn2):
    import numpy as np

    ref, _ = reference(STEPS, 2, 0.05, reinit=True)
    for rank, per_rank in enumerate(spawn2):
        for name in ref:
            assert_close(per_rank["delayed"][name], ref[name], f"delayed init rank={rank} {name}")
        for name, value in per_rank["hf"].items():  # every rank, both shard groups: one model
            assert np.array_equal(value, spawn2[0]["hf"][name]), f"rank {rank} differs in {name}"


def assert_close(a, b, what: str, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    import torch

    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    if not torch.allclose(a, b, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: max abs diff {float((a - b).abs().max()):.3g}")
