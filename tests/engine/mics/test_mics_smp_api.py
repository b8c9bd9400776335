"""Sharded data parallelism through the unchanged SMP API: delayed init, smp.step, clipping.

An SMP-style script body (smp.init with sharded_data_parallel_degree=2 and
delayed_parameter_initialization, smp.delay_param_initialization(), DistributedModel,
DistributedOptimizer, @smp.step with 2 micro-batches) on 4 ranks must give the weights of a
single-process PyTorch run on the union of the data, with sdp_gradient_clipping active; the replica
all-reduce runs during the last micro-batch's backward of each step (the overlapped path), not at step.
"""

from __future__ import annotations

import pytest

from tests._dist import run_ranks

STEPS, MICRO_PER_RANK = 3, 4


def _net():
    import torch

    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _data():
    import torch

    g = torch.Generator().manual_seed(99)
    return torch.randn(STEPS, 4, MICRO_PER_RANK, 8, generator=g), torch.randn(STEPS, 4, MICRO_PER_RANK, 4, generator=g)


def _smp_script() -> tuple[list[bool], dict, tuple[int, int], float, float]:
    import torch

    import smdistributed.modelparallel.torch as smp

    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": 2,
              "delayed_parameter_initialization": True, "sdp_param_persistence_threshold": 0,
              "sdp_gradient_clipping": 0.05})
    import deepspeed.utils.numa as ds_numa

    probes = []  # DeepSpeed's CPU device count runs `numactl` unless LOCAL_SIZE is set (smp.init sets it)
    real_probe = ds_numa.get_numa_cores
    ds_numa.get_numa_cores = lambda: probes.append(1) or real_probe()
    with smp.delay_param_initialization():
        net = _net()
    born = [hasattr(p, "ds_tensor") and p.ds_tensor.numel() == p.ds_numel // 2 for p in net.parameters()]
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    @smp.step
    def train_step(model, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    x, y = _data()
    for s in range(STEPS):
        opt.zero_grad()
        train_step(model, x[s, smp.dp_rank()], y[s, smp.dp_rank()])
        opt.step()
    trained = {k: v.float().numpy() for k, v in model.state_dict().items()}
    shard_coords = (smp.param_shard_rank(), smp.param_shard_size())

    # Load a full state dict (the untrained weights) on every rank, including shard group 1
    # whose members are not global rank 0, then take one more step: it must start from the
    # loaded weights (DeepSpeed's fp32 master partitions refreshed), so Adam moves each
    # element by about lr at most.
    initial = _net().state_dict()
    model.load_state_dict(initial)
    loaded_err = max((model.state_dict()[k] - v).abs().max().item() for k, v in initial.items())
    opt.zero_grad()
    train_step(model, x[0, smp.dp_rank()], y[0, smp.dp_rank()])
    opt.step()
    after_step_moved = max((model.state_dict()[k] - v).abs().max().item() for k, v in initial.items())
    # the replica all-reduce overlapped the last micro-batch's backward of every step (engine/mics/overlap.py)
    ds = model.backend.ds_optimizer
    overlap = {"async": ds.mics_overlap.async_elements, "sync": ds.mics_sync_elements,
               "partition": int(ds.grad_partitions_flat_buffer.numel()), "steps": STEPS + 1,
               "numa_probes": len(probes)}
    return born, trained, shard_coords, loaded_err, after_step_moved, overlap


@pytest.mark.slow
def test_smp_script_with_delayed_sharded_parameters_matches_single_process():
    import torch

    results = run_ranks(_smp_script, 4)
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    x, y = _data()
    for s in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[s].reshape(-1, 8)), y[s].reshape(-1, 4)).backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        assert norm > 0.05  # clipping bites
        opt.step()
    ref = net.state_dict()
    initial = _net().state_dict()
    for rank, (born, sd, shard_coords, loaded_err, moved, overlap) in enumerate(results):
        # every element was averaged over the replicas while backward ran, none at optimizer.step()
        assert overlap["async"] == overlap["steps"] * overlap["partition"] and overlap["sync"] == 0, overlap
        assert overlap["numa_probes"] == 0, overlap  # no `numactl` run per reduce-scatter bucket
        assert all(born), f"rank {rank}: parameters were not created partitioned over the shard group"
        # Shard groups are [0, 1] and [2, 3]: the rank inside the group, and its size.
        assert shard_coords == (rank % 2, 2), rank
        assert loaded_err == 0.0, f"rank {rank}: loaded weights differ by {loaded_err}"
        trained_distance = max(abs(sd[k] - initial[k.removeprefix("module.")].numpy()).max() for k in sd)
        assert trained_distance > 0.02  # the check below can tell loaded from trained weights
        assert moved <= 0.0105, f"rank {rank}: the step after loading started elsewhere (moved {moved})"
        assert sorted(k.removeprefix("module.") for k in sd) == sorted(ref)
        for key, value in sd.items():
            want = ref[key.removeprefix("module.")]
            assert torch.allclose(torch.as_tensor(value), want, rtol=1e-4, atol=1e-6), (rank, key)
