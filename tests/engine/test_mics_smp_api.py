"""Sharded data parallelism through the unchanged SMP API: delayed init, smp.step, clipping.

An SMP-style script body (smp.init with sharded_data_parallel_degree=2 and
delayed_parameter_initialization, smp.delay_param_initialization(), DistributedModel,
DistributedOptimizer, @smp.step with 2 micro-batches) on 4 ranks must give the weights of a
single-process PyTorch run on the union of the data, with sdp_gradient_clipping active.
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


def _smp_script() -> tuple[list[bool], dict]:
    import torch

    import smdistributed.modelparallel.torch as smp

    smp.init({"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": 2,
              "delayed_parameter_initialization": True, "sdp_param_persistence_threshold": 0,
              "sdp_gradient_clipping": 0.05})
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
    return born, {k: v.float().numpy() for k, v in model.state_dict().items()}


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
    for rank, (born, sd) in enumerate(results):
        assert all(born), f"rank {rank}: parameters were not created partitioned over the shard group"
        assert sorted(k.removeprefix("module.") for k in sd) == sorted(ref)
        for key, value in sd.items():
            want = ref[key.removeprefix("module.")]
            assert torch.allclose(torch.as_tensor(value), want, rtol=1e-4, atol=1e-6), (rank, key)
