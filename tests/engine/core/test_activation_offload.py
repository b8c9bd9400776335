"""Activation offloading (``offload_activations`` / ``activation_loading_horizon``), single process, CPU.

The checkpointed blocks of a small MLP have inputs of different widths, so the byte counts name
exactly which tensors went to CPU memory and came back.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from smp2ds.engine.core import activation_checkpointing as ac
from smp2ds.engine.core.activation_offload import get_offloader, offload_stats, reset_offload_stats
from smp2ds.engine.core.state import state
from smp2ds.engine.exceptions import SMPInvalidArgumentError
from tests.engine.runtime_fixtures import single_rank_runtime

WIDTHS = [8, 12, 16, 12, 10, 6, 4]  # block i maps WIDTHS[i] -> WIDTHS[i+1]
BLOCKS = len(WIDTHS) - 1
BATCH = 5
F32 = 4


def _block(i: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1]), torch.nn.Dropout(0.25), torch.nn.Tanh())


class Net(torch.nn.Module):
    """``mode``: "plain" (no checkpointing), "checkpoint" (smp.checkpoint per block),
    "sequential" (smp.checkpoint_sequential) or "wrapped" (smp.set_activation_checkpointing)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.blocks = torch.nn.Sequential(*[_block(i) for i in range(BLOCKS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "checkpoint":
            for block in self.blocks:
                x = ac.checkpoint(block, x)
            return x
        if self.mode == "sequential":
            return ac.checkpoint_sequential(self.blocks, x)
        return self.blocks(x)  # "plain", or "wrapped" (each block's forward is checkpointed)


def _make(mode: str, monkeypatch: pytest.MonkeyPatch) -> Net:
    torch.manual_seed(0)
    net = Net(mode)
    if mode == "wrapped":
        monkeypatch.setattr(state, "model", net)  # set_activation_checkpointing wants a DistributedModel
        ac.set_activation_checkpointing(net.blocks)
    return net


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTHS[0], generator=g), torch.randn(BATCH, WIDTHS[-1], generator=g))
            for _ in range(steps)]


def _train(net: Net, steps: int = 3, per_step=None) -> list[float]:
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    losses = []
    torch.manual_seed(123)  # the dropout masks
    for x, y in _batches(steps):
        reset_offload_stats()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if per_step is not None:
            per_step(offload_stats())
    return losses


def _expected_input_bytes() -> int:
    return sum(BATCH * WIDTHS[i] * F32 for i in range(BLOCKS))


# ---- (a) numerical equivalence ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["checkpoint", "sequential", "wrapped"])
@pytest.mark.parametrize("horizon", [1, 4])
def test_offloaded_training_matches_plain_training(mode, horizon, monkeypatch):
    plain = _make("plain", monkeypatch)
    reference = _train(plain)
    offloaded = _make(mode, monkeypatch)
    seen = []
    with ac.offload_activations(horizon):
        losses = _train(offloaded, per_step=seen.append)
    assert [s.activations_offloaded for s in seen] == [BLOCKS] * 3  # it really offloaded, every step
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-6, atol=0)
    assert len(set(reference)) == 3  # the model learns: three different losses
    for (name, p), q in zip(offloaded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0, msg=name)


def test_retain_graph_double_backward_reloads_again(monkeypatch):
    x, y = _batches(1)[0]
    grads = []
    for offload in (False, True):
        net = _make("checkpoint", monkeypatch)
        torch.manual_seed(7)
        with ac.offload_activations(2, enabled=offload):
            reset_offload_stats()
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward(retain_graph=True)
            loss.backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        if offload:
            assert offload_stats().bytes_reloaded == 2 * _expected_input_bytes()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


# ---- (b) what moves ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["checkpoint", "sequential", "wrapped"])
def test_offloaded_bytes_are_the_checkpointed_inputs(mode, monkeypatch):
    net = _make(mode, monkeypatch)
    seen = []
    with ac.offload_activations(2):
        _train(net, per_step=seen.append)
    assert len(seen) == 3
    for s in seen:
        assert s.activations_offloaded == BLOCKS and s.tensors_offloaded == BLOCKS
        assert s.bytes_offloaded == _expected_input_bytes() == 5 * 4 * sum(WIDTHS[:-1])
        assert s.bytes_reloaded == s.bytes_offloaded
        assert s.activations_consumed == BLOCKS and s.forward_passes == 1
    gc.collect()
    assert get_offloader()._pass.activations == {}  # nothing is kept once autograd freed the graph


def test_every_tensor_input_of_a_call_is_one_activation():
    class TwoInputs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, a, b, scale=1.0):
            return torch.tanh(self.lin(a) * b) * scale

    torch.manual_seed(0)
    blocks = [TwoInputs() for _ in range(3)]
    a = torch.randn(4, 6, requires_grad=True)
    b = torch.randn(4, 6)
    reset_offload_stats()
    with ac.offload_activations(4):
        h = a
        for block in blocks:
            h = ac.checkpoint(block, h, b, scale=2.0)
    s = offload_stats()
    assert (s.activations_offloaded, s.tensors_offloaded, s.bytes_offloaded) == (3, 6, 6 * 4 * 6 * 4)
    h.sum().backward()
    s = offload_stats()
    assert s.bytes_reloaded == 6 * 4 * 6 * 4 and s.activations_prefetched == 2 and s.activations_loaded_on_demand == 1


@pytest.mark.parametrize("offload", [False, True])
def test_offloading_frees_the_saved_device_tensors(offload):
    """Autograd keeps only the CPU copy: the block inputs die after forward when offloading, and
    live on (held by checkpoint) when not."""
    torch.manual_seed(0)
    blocks = [_block(i) for i in range(BLOCKS)]
    x = torch.randn(BATCH, WIDTHS[0])
    refs = []
    with ac.offload_activations(2, enabled=offload):
        h = x
        for block in blocks:
            h = ac.checkpoint(block, h)
            refs.append(weakref.ref(h))
    gc.collect()
    alive = [r() is not None for r in refs[:-1]]  # inputs of blocks 1..5 (the last output is h)
    assert alive == [not offload] * (BLOCKS - 1)
    h.sum().backward()
    assert all(p.grad is not None for b in blocks for p in b.parameters())


# ---- (c) the prefetch window -------------------------------------------------------------------
def _expected_events(blocks: int, horizon: int) -> list[tuple[str, int]]:
    """Backward unpacks k = n-1 ... 0; each unpack loads k if it is not there yet, then tops the
    window of prefetched-unconsumed activations up to ``horizon`` from k-1, k-2, ..."""
    events, loaded, in_flight = [], set(), set()
    for k in range(blocks - 1, -1, -1):
        events.append(("unpack", k))
        in_flight.discard(k)
        if k not in loaded:
            events.append(("load", k))
            loaded.add(k)
        for j in range(k - 1, max(-1, k - 1 - horizon), -1):
            if len(in_flight) < horizon and j not in loaded:
                events.append(("load", j))
                loaded.add(j)
                in_flight.add(j)
    return events


def test_expected_schedule_for_horizon_two_spelled_out():
    assert _expected_events(6, 2) == [("unpack", 5), ("load", 5), ("load", 4), ("load", 3), ("unpack", 4),
                                      ("load", 2), ("unpack", 3), ("load", 1), ("unpack", 2), ("load", 0),
                                      ("unpack", 1), ("unpack", 0)]


@pytest.mark.parametrize("horizon", [1, 2, 4, 8])
def test_prefetch_window_is_bounded_by_the_horizon_and_reached(horizon, monkeypatch):
    off = get_offloader()
    events = []
    load, unpack = off._load, off._unpack

    def spy_load(act):
        events.append(("load", act.index))
        return load(act)

    def spy_unpack(packed):
        events.append(("unpack", packed.activation.index))
        return unpack(packed)

    monkeypatch.setattr(off, "_load", spy_load)
    monkeypatch.setattr(off, "_unpack", spy_unpack)
    net = _make("checkpoint", monkeypatch)
    x, y = _batches(1)[0]
    reset_offload_stats()
    with ac.offload_activations(horizon):
        torch.nn.functional.mse_loss(net(x), y).backward()
    s = offload_stats()
    assert s.max_prefetched_unconsumed == min(horizon, BLOCKS - 1)
    assert s.max_prefetched_unconsumed <= horizon
    assert (s.activations_prefetched, s.activations_loaded_on_demand) == (BLOCKS - 1, 1)
    assert events == _expected_events(BLOCKS, horizon)


def test_window_cap_holds_when_backward_skips_activations():
    """Two chains interleaved in forward order (A0 B0 A1 B1 A2 B2 = activations 0..5); backward
    of chain A alone prefetches B activations it will not consume. The window must still never
    hold more than ``horizon`` prefetched-unconsumed activations (the cap, not only the k-1..k-h
    range, bounds it), and both backward passes must reproduce plain checkpointing."""
    torch.manual_seed(0)
    widths = [12, 16, 12, 8]
    a_blocks, b_blocks = ([torch.nn.Sequential(torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.Dropout(0.25),
                                               torch.nn.Tanh()) for i in range(3)] for _ in range(2))
    xa, xb = torch.randn(3, 12), torch.randn(3, 12)
    grads = []
    for offload in (False, True):
        reset_offload_stats()
        torch.manual_seed(5)
        with ac.offload_activations(2, enabled=offload):
            ha, hb = xa, xb
            for block_a, block_b in zip(a_blocks, b_blocks):
                ha = ac.checkpoint(block_a, ha)
                hb = ac.checkpoint(block_b, hb)
            ha.square().sum().backward()
            hb.square().sum().backward()
        grads.append([p.grad.clone() for b in a_blocks + b_blocks for p in b.parameters()])
        for b in a_blocks + b_blocks:
            b.zero_grad(set_to_none=True)
    s = offload_stats()
    assert s.activations_offloaded == 6 and s.bytes_reloaded == s.bytes_offloaded == 3 * 4 * (12 + 16 + 12) * 2
    assert s.max_prefetched_unconsumed == 2
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_horizon_comes_from_the_running_plan(monkeypatch):
    params = {"offload_activations": True, "activation_loading_horizon": 3}
    monkeypatch.setattr(state, "runtime", single_rank_runtime(params))
    assert ac.offload_horizon() == 3
    net = _make("wrapped", monkeypatch)
    seen = []
    _train(net, steps=1, per_step=seen.append)
    assert seen[0].max_prefetched_unconsumed == 3 and seen[0].bytes_offloaded == _expected_input_bytes()
    with ac.offload_activations(enabled=False):  # an explicit override wins over the config
        assert ac.offload_horizon() is None
    monkeypatch.setattr(state, "runtime", single_rank_runtime({"offload_activations": False}))
    assert ac.offload_horizon() is None


# ---- (d) no offloading -------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["checkpoint", "sequential", "wrapped"])
def test_plain_checkpointing_runs_no_pack_hooks(mode, monkeypatch):
    monkeypatch.setattr(state, "runtime", None)  # no smp.init: no config asks for offloading
    assert ac.offload_horizon() is None
    calls = []
    pack = get_offloader()._pack
    monkeypatch.setattr(get_offloader(), "_pack", lambda *a: calls.append(a) or pack(*a))
    seen = []
    _train(_make(mode, monkeypatch), per_step=seen.append)
    assert calls == []
    assert all(s == type(s)() for s in seen) and len(seen) == 3  # every counter 0
    with ac.offload_activations(1):  # the spy itself works
        _train(_make(mode, monkeypatch), steps=1)
    assert len(calls) == BLOCKS


def test_no_grad_and_nested_calls_are_not_offloaded_twice(monkeypatch):
    inner = [_block(i) for i in range(2)]

    class Outer(torch.nn.Module):
        def forward(self, h):
            for block in inner:
                h = ac.checkpoint(block, h)
            return h

    x, _ = _batches(1)[0]
    torch.manual_seed(0)
    reset_offload_stats()
    with ac.offload_activations(2), torch.no_grad():
        ac.checkpoint(Outer(), x)
    assert offload_stats().activations_offloaded == 0
    grads = []
    for offload in (False, True):
        torch.manual_seed(0)
        with ac.offload_activations(2, enabled=offload):
            ac.checkpoint(Outer(), x.clone().requires_grad_()).sum().backward()
        grads.append([p.grad.clone() for b in inner for p in b.parameters()])
        for b in inner:
            b.zero_grad(set_to_none=True)
    s = offload_stats()
    assert (s.activations_offloaded, s.bytes_offloaded, s.bytes_reloaded) == (1, x.numel() * 4, x.numel() * 4)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def test_horizon_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True, "4"):
        with pytest.raises(SMPInvalidArgumentError, match="activation_loading_horizon"):
            with ac.offload_activations(bad):
                pass
    assert ac.offload_horizon() is None  # a refused override leaves nothing behind
