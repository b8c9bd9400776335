"""Single-process unit tests of SMP's device placement for ``@smp.step`` inputs (device_placement).

No GPU is needed: the target device is ``torch.device("meta")``, so a moved tensor is visibly a
new tensor on ``meta`` while a tensor already there, every non-tensor and every container with
nothing to move stay the very same objects. The other devices in the mismatch checks are only
``torch.device`` values (``cuda:1`` never holds a tensor here).
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from smp2ds.engine.api.step import StepFunction
from smp2ds.engine.core import device_placement as placement
from smp2ds.engine.core.microbatch_split import split_value
from smp2ds.engine.core.step_output import StepOutput
from smp2ds.engine.exceptions import SMPInvalidArgumentError

META = torch.device("meta")
Pair = namedtuple("Pair", "ids mask")


class Recorded(torch.Tensor):
    """A CPU tensor that says whether it is pinned and records the keyword arguments of ``.to``
    (CPU-only torch cannot pin memory, so the pinned case is simulated here)."""

    pinned = False
    calls: list[dict] = []

    def is_pinned(self) -> bool:
        return self.pinned

    def to(self, *args, **kwargs):
        Recorded.calls.append(dict(kwargs))
        return super().to(*args, **kwargs)


class Pinned(Recorded):
    pinned = True


def test_the_device_is_the_accelerators_device_of_this_local_rank_and_none_on_the_cpu():
    assert placement.device_for("cuda", 3) == torch.device("cuda", 3)
    assert placement.device_for("cpu", 3) is None
    # Later pipeline stages run with the first stage's inputs: they never move their own.
    assert placement.step_input_device(local_rank=0, pp_rank=1) is None
    # The first stage's device is DeepSpeed's engine.device for that local rank (None for the CPU
    # accelerator, which the tests run: DS_ACCELERATOR=cpu).
    from deepspeed.accelerator import get_accelerator

    engine_device = torch.device(get_accelerator().device_name(2))
    expected = None if engine_device.type == "cpu" else engine_device
    assert placement.step_input_device(local_rank=2, pp_rank=0) == expected


def test_cpu_tensors_move_and_everything_else_stays_the_same_object():
    ids, on_meta, model = torch.arange(8).reshape(4, 2), torch.empty(4, 3, device=META), torch.nn.Linear(2, 2)
    batch = {"pair": Pair(ids, on_meta), "rows": [ids.float(), 7, "text"], "ready": (on_meta, None),
             "set": {3}, "step_out": StepOutput([torch.ones(1)])}
    moved = placement.to_device(batch, META)
    assert moved is not batch and type(moved) is dict
    assert isinstance(moved["pair"], Pair) and moved["pair"].ids.device == META
    assert moved["pair"].ids.shape == (4, 2) and moved["pair"].ids.dtype == torch.int64
    assert moved["pair"].mask is on_meta  # already on the device: no copy
    assert moved["rows"][0].device == META and moved["rows"][1] == 7 and moved["rows"][2] == "text"
    assert moved["ready"] is batch["ready"]  # nothing inside moved: the same tuple
    assert moved["set"] is batch["set"] and moved["step_out"] is batch["step_out"]
    assert ids.device.type == "cpu"  # the caller's tensors are not changed in place
    assert placement.to_device(model, META) is model  # objects are passed as they are


def test_a_tokenizers_batch_encoding_keeps_its_type():
    from transformers import BatchEncoding

    enc = BatchEncoding({"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5)})
    moved = placement.to_device(enc, META)
    assert type(moved) is BatchEncoding and moved["input_ids"].device == META and moved.input_ids.dtype == torch.long
    assert enc["input_ids"].device.type == "cpu"


def test_tensors_on_the_device_already_are_not_copied():
    x = torch.empty(6, device=META)
    args = (x, [x], {"x": x})
    assert placement.to_device(args, META) is args
    assert placement.needs_copy(torch.device("cuda", 0), torch.device("cuda", 0), "x") is False
    assert placement.needs_copy(torch.device("cpu"), torch.device("cuda", 0), "x") is True


def test_pinned_sources_are_copied_non_blocking_and_pageable_ones_blocking():
    Recorded.calls.clear()
    pageable, pinned = torch.ones(3).as_subclass(Recorded), torch.ones(3).as_subclass(Pinned)
    assert placement.copies_async(pageable) is False and placement.copies_async(pinned) is True
    assert placement.copies_async(torch.ones(3)) is False  # a plain CPU tensor is pageable memory
    out = placement.to_device([pageable, pinned], META)
    assert [t.device for t in out] == [META, META]
    assert Recorded.calls == [{"non_blocking": False}, {"non_blocking": True}]


def test_a_tensor_on_another_device_is_an_error_naming_the_argument_and_both_devices():
    with pytest.raises(SMPInvalidArgumentError, match=r"^argument 'x' is a tensor on cuda:1, but the model runs on "
                       r"cuda:0: an smp.step function takes tensors on the CPU \(moved to cuda:0\) or on cuda:0"):
        placement.needs_copy(torch.device("cuda", 1), torch.device("cuda", 0), "argument 'x'")

    def step(model, batch, *, labels):
        return None

    fn = StepFunction(step)
    # A meta tensor stands for a tensor on a device other than the model's (cuda:0 here).
    with pytest.raises(SMPInvalidArgumentError, match=r"argument 'batch'\['ids'\]\[1\] is a tensor on meta, but the "
                       "model runs on cuda:0"):
        fn.to_device(("model", {"ids": [3, torch.empty(2, device=META)]}), {}, torch.device("cuda", 0))
    with pytest.raises(SMPInvalidArgumentError, match=r"argument 'labels' is a tensor on meta"):
        fn.to_device(("model", {}), {"labels": torch.empty(2, device=META)}, torch.device("cuda", 0))


def test_positional_keyword_and_non_split_arguments_move_and_split_into_device_views():
    def step(model, x, extra, flag=False):
        return None

    fn = StepFunction(step, non_split_inputs=["extra"])
    model, x, extra = torch.nn.Linear(2, 2), torch.arange(8.0).reshape(4, 2), {"w": torch.ones(3)}
    args, kwargs = fn.to_device((model, x, extra), {"flag": torch.tensor([True, False, True, False])}, META)
    assert args[0] is model and args[1].device == META and args[2]["w"].device == META
    assert kwargs["flag"].device == META
    pieces = fn.split(args, kwargs, 2)
    assert [p[0][1].shape for p in pieces] == [(2, 2), (2, 2)] and all(p[0][1].device == META for p in pieces)
    assert all(p[0][2] is args[2] for p in pieces)  # non_split_inputs: the same moved object whole
    assert [p[1]["flag"].shape for p in pieces] == [(2,), (2,)]
    assert split_value(args[1], 2, 0, "x")[1].device == META
