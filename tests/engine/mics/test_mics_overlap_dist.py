"""The MiCS replica all-reduce overlapped with backward (engine/mics/overlap.py), real processes.

One spawn of 4 ranks, S = 2 (R = 2 replica groups), a 4-layer MLP and ``reduce_bucket_size`` 300
so that DeepSpeed's ZeRO-3 reduce-scatters one layer per bucket during backward. Each run records,
in one ordered log, the overlap's own events (``issue``: an asynchronous replica all-reduce
started; ``wait``: waited on in ``step``) and markers the test adds: the start of each
micro-batch, the backward pre-hook of the first layer (the last layer backward reaches),
``engine.backward`` returning and ``engine.step`` returning. Final weights are compared between
the overlapped and the synchronous path (``overlap=False``: bit-identical with R = 2) and with
a single-process plain-PyTorch run on the union of the ranks' data (Adam, fp32). A last pair of
runs calls backward twice before each step: the first backward's all-reduces must be dropped.
"""

from __future__ import annotations

import os

import pytest

from tests._dist import run_ranks
from tests.engine.mics.test_mics_dist import _init_dist

WORLD, SHARD, STEPS, MICRO, LR = 4, 2, 3, 2, 0.01
SIZES = (8, 16, 16, 16, 4)  # every weight/bias numel is even: S = 2 partitions carry no padding
BUCKET = 300  # elements: one Linear layer (<= 16x16+16) per reduce-scatter bucket


def _model():
    import torch

    torch.manual_seed(7)
    layers: list = []
    for a, b in zip(SIZES, SIZES[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _data(gas: int):
    import torch

    g = torch.Generator().manual_seed(3)
    return (torch.randn(STEPS, WORLD, gas, MICRO, SIZES[0], generator=g),
            torch.randn(STEPS, WORLD, gas, MICRO, SIZES[-1], generator=g))


def _reference(gas: int, clip: float, backwards: int = 1) -> dict:
    import torch

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = _data(gas)
    for s in range(STEPS):
        opt.zero_grad()
        for _ in range(backwards):
            torch.nn.functional.mse_loss(model(x[s].reshape(-1, SIZES[0])), y[s].reshape(-1, SIZES[-1])).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(gas: int, clip: float, overlap: bool, backwards: int = 1) -> dict:
    """``backwards`` > 1: the boundary micro-batch is run backward that many times before step."""
    import torch

    from smp2ds.engine import mics
    from smp2ds.translator.topology import Topology

    rank = int(os.environ["RANK"])
    groups = mics.MicsGroups.create(Topology(rdp=WORLD), SHARD)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
           "train_batch_size": MICRO * gas * WORLD, "gradient_clipping": clip, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET, "stage3_param_persistence_threshold": 0,
                                 "stage3_max_live_parameters": 1_000_000_000}}
    model = _model()
    engine, opt = mics.initialize(model, torch.optim.Adam(model.parameters(), lr=LR), cfg, groups, overlap=overlap)
    log: list = opt.mics_overlap.log if opt.mics_overlap is not None else []
    engine.module[0].register_full_backward_pre_hook(lambda *_: log.append(("layer0-backward", 0)))
    x, y = _data(gas)
    for s in range(STEPS):
        for m in range(gas):
            log.append(("micro-start", m))
            for _ in range(backwards if m == gas - 1 else 1):
                engine.backward(torch.nn.functional.mse_loss(engine(x[s, rank, m]), y[s, rank, m]))
                log.append(("backward-returned", m))
            engine.step()
        log.append(("step-returned", s))
    # numpy, not tensors: torch's shared-memory pickling breaks when the rank exits first
    weights = {k: v.numpy() for k, v in mics.full_state_dict(engine).items()}
    return {"weights": weights, "log": list(log),
            "partition": int(opt.grad_partitions_flat_buffer.numel()), "syncs": opt.mics_replica_syncs,
            "sync_elements": opt.mics_sync_elements,
            "async_elements": opt.mics_overlap.async_elements if opt.mics_overlap is not None else 0}


def _worker() -> dict:
    _init_dist()
    runs = {(gas, overlap): _train(gas, clip, overlap)
            for gas, clip in ((1, 0.0), (2, 0.05)) for overlap in (True, False)}
    runs.update({("twice", overlap): _train(1, 0.0, overlap, backwards=2) for overlap in (True, False)})
    return runs


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_worker, WORLD)


def _steps(log: list) -> list[list]:
    """The log cut at each ``step-returned``."""
    out, cur = [], []
    for event in log:
        cur.append(event)
        if event[0] == "step-returned":
            out.append(cur)
            cur = []
    return out


@pytest.mark.slow
@pytest.mark.parametrize("gas", [1, 2])
def test_replica_allreduce_is_issued_during_backward_and_waited_before_the_step(runs, gas):
    layers = len(SIZES) - 1
    for rank, per_rank in enumerate(runs):
        r = per_rank[(gas, True)]
        steps = _steps(r["log"])
        assert len(steps) == STEPS, r["log"]
        for events in steps:
            names = [e[0] for e in events]
            last_micro = len(names) - 1 - names[::-1].index("micro-start")
            # Nothing before the boundary micro-batch: its partitions are not final yet.
            assert "issue" not in names[:last_micro], (rank, names)
            issues = [i for i, n in enumerate(names) if n == "issue"]
            assert len(issues) == layers, (rank, names)  # one all-reduce per reduce-scatter bucket
            # Issued while backward still had layers to go: before the first layer's backward began.
            assert issues[0] < names.index("layer0-backward", last_micro), (rank, names)
            returned = names.index("backward-returned", last_micro)
            assert all(i < returned for i in issues), (rank, names)
            waits = [i for i, n in enumerate(names) if n == "wait"]
            assert len(waits) == layers and all(returned < i < names.index("step-returned") for i in waits)
        # Every element of the partition was averaged by the overlapped path, none at step.
        assert r["async_elements"] == STEPS * r["partition"] and r["sync_elements"] == 0, r
        assert r["syncs"] == STEPS
        off = per_rank[(gas, False)]
        assert not {"issue", "wait"} & {e[0] for e in off["log"]}, off["log"]
        assert off["sync_elements"] == STEPS * off["partition"] and off["async_elements"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("gas, clip", [(1, 0.0), (2, 0.05)])
def test_overlapped_weights_equal_synchronous_path_and_plain_pytorch(runs, gas, clip):
    import torch

    ref = _reference(gas, clip)
    for rank, per_rank in enumerate(runs):
        on, off = ({k: torch.from_numpy(v) for k, v in per_rank[(gas, o)]["weights"].items()} for o in (True, False))
        assert on.keys() == off.keys() == ref.keys()
        for k in ref:
            assert torch.equal(on[k], off[k]), (rank, k, (on[k] - off[k]).abs().max())
            torch.testing.assert_close(on[k], ref[k], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {k}")
            assert not torch.equal(on[k], _model().state_dict()[k]), f"{k} did not train"


@pytest.mark.slow
def test_a_second_backward_before_step_drops_the_first_ones_all_reduces(runs):
    """Two backwards before one step (gradients accumulate): the all-reduces issued in the first
    are dropped when the second begins (``backward_prologue``), the second's cover everything."""
    import torch

    ref = _reference(1, 0.0, backwards=2)
    layers = len(SIZES) - 1
    for rank, per_rank in enumerate(runs):
        on, off = per_rank[("twice", True)], per_rank[("twice", False)]
        for events in _steps(on["log"]):
            names = [e[0] for e in events]
            second = names.index("backward-returned")
            assert names[:second].count("issue") == layers and names[second:].count("issue") == layers, names
            assert names.count("wait") == layers and names.index("wait") > names.index("backward-returned", second + 1)
        assert on["async_elements"] == STEPS * on["partition"] and on["sync_elements"] == 0
        for k in ref:
            a, b = torch.from_numpy(on["weights"][k]), torch.from_numpy(off["weights"][k])
            assert torch.equal(a, b), (rank, k)
            torch.testing.assert_close(a, ref[k], rtol=1e-4, atol=1e-6, msg=f"rank {rank} {k}")
