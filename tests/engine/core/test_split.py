"""Single-process unit tests: micro-batch splitting, StepOutput and output collection."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from smp2ds.engine.core.microbatch_split import check_spec, positional_names, split_call, split_value
from smp2ds.engine.core.step_output import StepOutput, collect
from smp2ds.engine.exceptions import TensorSplitError


def f(model, x, y, *rest, flag=False, **extra):
    return None


def test_tensors_split_along_dim0_into_equal_views():
    x = torch.arange(12.0).reshape(6, 2)
    parts = split_value(x, 3, 0, "x")
    assert [p.tolist() for p in parts] == [x[0:2].tolist(), x[2:4].tolist(), x[4:6].tolist()]
    assert parts[1].data_ptr() == x[2].data_ptr()  # narrow: views, no copies


def test_nested_structures_and_kwargs_are_split_and_rebuilt():
    Pair = namedtuple("Pair", "a b")
    batch = {"ids": torch.arange(4), "pair": Pair(torch.ones(4, 2), 7), "lst": [torch.zeros(4)], "s": "keep"}
    pieces = split_call(f, ("model", batch, torch.arange(8).reshape(4, 2)), {"flag": torch.arange(4)}, 2,
                        frozenset(), {})
    assert len(pieces) == 2
    args1, kwargs1 = pieces[1]
    assert args1[0] == "model"
    assert args1[1]["ids"].tolist() == [2, 3] and isinstance(args1[1]["pair"], Pair)
    assert args1[1]["pair"].b == 7 and args1[1]["s"] == "keep" and args1[1]["lst"][0].shape == (2,)
    assert args1[2].tolist() == [[4, 5], [6, 7]] and kwargs1["flag"].tolist() == [2, 3]


def test_non_split_inputs_input_split_axes_and_var_args_by_name():
    x, y, z = torch.ones(4, 6), torch.arange(6).reshape(1, 6), torch.arange(4)
    pieces = split_call(f, ("m", x, y, z), {"extra": torch.arange(4)}, 2, frozenset({"x", "extra"}), {"y": 1, "rest": 0})
    (a0, k0), (a1, _) = pieces
    assert a0[1] is x and k0["extra"].shape == (4,)  # passed whole
    assert a0[2].tolist() == [[0, 1, 2]] and a1[2].tolist() == [[3, 4, 5]]  # axis 1
    assert a1[3].tolist() == [2, 3]  # *rest element split on its own axis
    assert positional_names(f, 5) == ["model", "x", "y", "rest", "rest"]


def test_not_divisible_is_a_clear_error():
    with pytest.raises(TensorSplitError, match=r"argument 'x'.*microbatches=4: dimension 0 has size 6.*shape \(6, 3\)"):
        split_call(f, ("m", torch.ones(6, 3), None), {}, 4, frozenset(), {})
    with pytest.raises(TensorSplitError, match="0-dimensional tensor; list it in non_split_inputs"):
        split_value(torch.tensor(1.0), 2, 0, "argument 'w'")
    with pytest.raises(TensorSplitError, match="only 1 dimension"):
        split_value(torch.ones(4), 2, 1, "argument 'w'")


def test_bad_decorator_arguments_are_rejected():
    assert check_spec(["a"], {"b": 1}) == (frozenset({"a"}), {"b": 1})
    with pytest.raises(TensorSplitError, match="non_split_inputs must be a list"):
        check_spec("a", None)
    with pytest.raises(TensorSplitError, match="input_split_axes must be a dict"):
        check_spec(None, {"b": "1"})


def test_smp_slice_and_step_output_arguments():
    class Sliceable:
        def smp_slice(self, num_mb, mb, axis):
            return (num_mb, mb, axis)

    so = StepOutput([torch.tensor(1.0), torch.tensor(2.0)])
    assert split_value(Sliceable(), 2, 1, "s") == [(2, 0, 1), (2, 1, 1)]
    assert split_value(so, 2, 0, "so") == so.outputs
    with pytest.raises(TensorSplitError, match="3 outputs, expected 2"):
        split_value(StepOutput([1, 2, 3]), 2, 0, "so")


def test_step_output_reductions_match_hand_computation():
    outs = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0]), torch.tensor([0.5, 0.5])]
    so = StepOutput(outs)
    assert so.reduce_mean().tolist() == [1.5, 2.5]
    assert so.reduce_sum().tolist() == [4.5, 7.5]
    assert so.concat().tolist() == [1.0, 2.0, 3.0, 5.0, 0.5, 0.5]
    assert so.stack().shape == (3, 2) and so[1] is outs[1] and len(so) == 3 and list(so) == outs
    assert so.map(lambda t: t * 2).outputs[0].tolist() == [2.0, 4.0]


def test_collect_keeps_structure_and_detaches():
    w = torch.ones(1, requires_grad=True)
    results = [{"loss": w * i, "aux": (torch.full((2,), float(i)), i, "tag")} for i in range(2)]
    out = collect(results, detach=True)
    assert isinstance(out["loss"], StepOutput) and not out["loss"].outputs[1].requires_grad
    assert out["aux"][0].concat().tolist() == [0.0, 0.0, 1.0, 1.0]
    assert out["aux"][1] == [0, 1] and out["aux"][2] == ["tag", "tag"]
    assert collect(results, detach=False)["loss"].outputs[1].requires_grad


def test_collect_hugging_face_model_output():
    from transformers.modeling_outputs import CausalLMOutput

    results = [CausalLMOutput(logits=torch.ones(2, 3) * i) for i in range(2)]  # lone field: the tricky case
    out = collect(results)
    assert isinstance(out, CausalLMOutput) and isinstance(out.logits, StepOutput)
    assert out["logits"].concat().shape == (4, 3) and out.loss is None
    both = collect([CausalLMOutput(loss=torch.tensor(float(i)), logits=torch.zeros(1, 2)) for i in range(2)])
    assert both.loss.reduce_mean().item() == 0.5 and both[0] is both.loss
