"""``@smp.step`` input placement through the real path (``smp.init`` -> ``DistributedModel`` ->
DeepSpeed engine -> micro-batch split), in a real process started by the test harness.

On the CPU the step function must get exactly what it got before placement existed: micro-batch
slices that are views of the caller's tensors (same storage, predictable offsets), the caller's
``non_split_inputs`` objects themselves, never traversed (a mapping that counts its reads stays
at zero), and training equal to plain PyTorch. Then the same model is given the ``meta`` device
as its input device (a stand-in for ``cuda:local_rank()``, which this machine lacks): the step
receives every tensor there, tensors already there and non-tensors unchanged, and a tensor on a
third device is refused with one SMP error naming both devices.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from tests._dist import run_ranks

B, MB, STEPS = 8, 2, 2


class CountingMapping(Mapping):
    """A read-only mapping that counts how often it is read (to see whether anything traversed it)."""

    def __init__(self, data: dict):
        self.data, self.reads = dict(data), 0

    def __getitem__(self, key: Any) -> Any:
        self.reads += 1
        return self.data[key]

    def __iter__(self) -> Iterator:
        self.reads += 1
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def placement_run() -> dict:
    import torch
    import torch.nn.functional as F

    import smdistributed.modelparallel.torch as smp
    from tests.engine.workers.train_workers import make_model, plain, rank_batch

    smp.init({"ddp": True, "microbatches": MB})
    model = smp.DistributedModel(make_model(0))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    out: dict[str, Any] = {"input_device": model._input_device, "cpu": [], "losses": []}

    @smp.step(non_split_inputs=["extra"])
    def train_step(model, x, y, extra, tag):
        out["cpu"].append({"x": x.data_ptr(), "y": y.data_ptr(), "extra": extra, "reads": extra.reads, "tag": tag})
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    given = []
    for step in range(STEPS):
        x, y = rank_batch(step, 1, B, 0)
        extra, tag = CountingMapping({"w": torch.ones(3)}), object()
        given.append((x, y, extra, tag))
        optimizer.zero_grad()
        out["losses"].append(float(train_step(model, x, y, extra, tag).reduce_mean()))
        optimizer.step()
    half, seen_cpu = B // MB, out.pop("cpu")
    out["cpu_ok"] = [
        [seen["x"] == x.data_ptr() + i * half * x.stride(0) * x.element_size(),
         seen["y"] == y.data_ptr() + i * half * y.stride(0) * y.element_size(),
         seen["extra"] is extra, seen["reads"] == 0, seen["tag"] is tag]
        for step, (x, y, extra, tag) in enumerate(given)
        for i, seen in enumerate(seen_cpu[step * MB:(step + 1) * MB])]
    out["weights"] = plain(model.state_dict())

    # The same path with a device to move to: meta stands for cuda:local_rank().
    meta = torch.device("meta")
    object.__setattr__(model, "_input_device", meta)
    seen_meta: list[dict] = []

    @smp.step(non_split_inputs=["extra", "ready"])
    def probe(model_arg, x, extra, ready, tag):
        seen_meta.append({"x": (x.device.type, tuple(x.shape)), "w": extra["w"].device.type,
                          "extra_type": type(extra).__name__, "extra_moved": extra is not given_extra,
                          "ready": ready is on_meta, "tag": tag is given_tag, "model": model_arg is model})
        return 0

    x, _ = rank_batch(0, 1, B, 0)
    given_extra, given_tag, on_meta = CountingMapping({"w": torch.ones(3)}), object(), torch.empty(B, device=meta)
    probe(model, x, given_extra, on_meta, given_tag)
    out["meta"] = seen_meta
    out["meta_reads"] = given_extra.reads
    out["x_still_cpu"] = x.device.type

    # A tensor on a device other than the model's (cuda:0 now; meta is the third device here).
    object.__setattr__(model, "_input_device", torch.device("cuda", 0))
    try:
        probe(model, torch.empty(B, 2, device=meta), {}, None, None)
    except Exception as exc:  # noqa: BLE001 - the class and message are the result
        out["mismatch"] = (type(exc).__name__, str(exc))
    object.__setattr__(model, "_input_device", None)
    smp.barrier()
    return out


def reference() -> tuple[list[float], dict]:
    """Plain PyTorch: the whole batch at once (MSE over equal halves averages to the whole's)."""
    import torch
    import torch.nn.functional as F

    from tests.engine.workers.train_workers import make_model, rank_batch

    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = rank_batch(step, 1, B, 0)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


@pytest.mark.slow
def test_step_inputs_are_untouched_on_cpu_and_moved_to_the_models_device_otherwise():
    import torch

    (out,) = run_ranks(placement_run, 1)
    assert out["input_device"] is None  # DeepSpeed's CPU accelerator: nothing to move
    assert out["cpu_ok"] == [[True] * 5] * (STEPS * MB), out["cpu_ok"]
    ref_losses, ref_weights = reference()
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-5)
    for key, value in ref_weights.items():
        torch.testing.assert_close(torch.from_numpy(out["weights"][key]), value, rtol=1e-5, atol=1e-6)

    half = B // MB
    assert out["meta"] == [{"x": ("meta", (half, 8)), "w": "meta", "extra_type": "CountingMapping",
                            "extra_moved": True, "ready": True, "tag": True, "model": True}] * MB
    assert out["meta_reads"] > 0 and out["x_still_cpu"] == "cpu"
    kind, message = out["mismatch"]
    assert kind == "SMPInvalidArgumentError"
    assert message.startswith("argument 'x' is a tensor on meta, but the model runs on cuda:0"), message
