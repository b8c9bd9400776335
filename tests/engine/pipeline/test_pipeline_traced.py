"""The traced pipeline path (any nn.Module via torch.fx) and the first stage's step inputs, in one process.

Multi-rank training of a traced model against a reference is in tests/scripts/test_pipeline_scripts.py.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from smp2ds.engine.exceptions import SMPRuntimeError
from smp2ds.engine.pipeline import (
    UnsupportedModelError,
    build_layer_list,
    clear_partitions,
    partition,
    plan_partition,
    set_partition,
    step_inputs,
)
from smp2ds.engine.pipeline.fx_segments import TracedLayer
from smp2ds.engine.pipeline.stage_state_dict import StateNames


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 3, 3)
        self.bn = nn.BatchNorm2d(3)
        self.conv2 = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        x = F.relu(self.bn(self.conv1(x)))
        return torch.flatten(F.max_pool2d(self.conv2(x), 2), 1)


class Dense(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(36, 8)
        self.scale = nn.Parameter(torch.full((8,), 0.5))
        self.register_buffer("offset", torch.linspace(-1, 1, 8))
        self.fc2 = nn.Linear(8, 5)

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) * self.scale + self.offset
        return F.log_softmax(self.fc2(h), dim=1)


class Grouped(nn.Module):
    """SMP's MNIST shape: a forward chaining two custom children."""

    def __init__(self, contexts: bool = False):
        super().__init__()
        if contexts:
            with partition(0):
                self.net1 = Convs()
            with partition(1):
                self.net2 = Dense()
        else:
            self.net1, self.net2 = Convs(), Dense()

    def forward(self, x):
        return self.net2(self.net1(x))


def run_layers(layer_list, inputs):
    x = inputs
    for layer in layer_list.layers:
        x = layer.entry(x)
    return x


def test_traced_layer_list_reproduces_forward_and_gradients_exactly():
    torch.manual_seed(0)
    model = Grouped()
    layer_list = build_layer_list(model)
    assert layer_list.family == "torch.fx traced"
    assert layer_list.names == ["net1.conv1", "net1.bn", "net1.conv2", "net2.fc1", "net2.scale", "net2.offset",
                                "net2.fc2"]
    x = torch.randn(4, 1, 10, 10)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_stats = model.net1.bn.running_mean.clone()
    model.zero_grad()
    torch.manual_seed(0)
    model2 = Grouped()  # fresh BatchNorm statistics, same weights
    layer_list = build_layer_list(model2)
    out = run_layers(layer_list, layer_list.adapter.pipe_inputs((x,), {}))
    assert torch.equal(out, ref)
    out.square().sum().backward()
    for name, p in model2.named_parameters():
        assert torch.equal(p.grad, ref_grads[name]), name
    assert torch.equal(model2.net1.bn.running_mean, ref_stats)
    # layers hold the original parameters (shared, not copied)
    held = {id(p) for layer in layer_list.layers for p in layer.entry.parameters()}
    assert held == {id(p) for p in model2.parameters()}


def test_traced_layers_follow_manual_partition_contexts_and_set_partition():
    clear_partitions()
    try:
        layer_list = build_layer_list(Grouped(contexts=True))
        plan = plan_partition(layer_list, 2, auto=False, default_partition=0)
        assert plan.parts == (0, 3, 7)
        assert plan.describe().startswith("pipeline split (manual): stage 0 = layers 0-2 [net1.conv1 .. net1.conv2]")
        model = Grouped()
        set_partition(model.net2.fc2, 1)
        plan = plan_partition(build_layer_list(model), 2, auto=False, default_partition=0)
        assert plan.parts == (0, 6, 7)
        auto = plan_partition(build_layer_list(Grouped()), 2, auto=True)
        assert len(auto.stages) == 2 and all(s.stop > s.start for s in auto.stages)
    finally:
        clear_partitions()


def test_buffers_read_directly_keep_their_state_dict_keys():
    model = Grouped()
    layer_list = build_layer_list(model)
    names = StateNames(model, layer_list.buffer_slots)
    stage = nn.ModuleList([layer.entry for layer in layer_list.layers])
    keys = {key for key, _ in names.local_tensors(stage)}
    assert keys == set(model.state_dict())
    assert ("net2.offset" in {key for _, _, key in layer_list.buffer_slots})


class BranchesInChild(nn.Module):
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent Python control flow: fx cannot trace it
                return self.lin(x)
            return x

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.inner = self.Inner()

    def forward(self, x):
        return self.inner(self.first(x))


def test_tracing_failure_names_the_module_the_construct_and_the_manual_route():
    with pytest.raises(UnsupportedModelError) as err:
        build_layer_list(BranchesInChild())
    text = str(err.value)
    assert "tracing failed in BranchesInChild.inner: TraceError: symbolically traced variables cannot be used as " \
           "inputs to control flow" in text
    assert "torch.nn.Sequential" in text and "smp.set_partition(child, i)" in text
    assert "transformers GPT2LMHeadModel" in text  # the named families are the other way out


class AllDefaults(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x=None):
        return self.b(self.a(x))


def test_a_forward_without_tensor_inputs_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"every argument of its forward\(x=None\) has a default"):
        build_layer_list(AllDefaults())


class SizeAcross(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        n = x.size(0)
        return self.b(self.a(x)).reshape(n, -1)


class TiedEnds(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, ids):
        return F.linear(self.mid(self.emb(ids)), self.emb.weight)


@pytest.mark.parametrize("model, reason", [
    (SizeAcross(), "no cut before b: non-tensor value(s) ['size'] would cross"),
    (TiedEnds(), "no cut before mid: emb.weight is used on both sides"),
])
def test_models_without_a_cut_are_refused_with_the_reason(model, reason):
    with pytest.raises(UnsupportedModelError) as err:
        build_layer_list(model)
    text = str(err.value)
    assert "its traced forward has no place to cut between stages" in text and reason in text


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, mask=None, scale: float = 1.0):
        h = self.a(x)
        if mask is not None:
            h = h * mask
        return self.b(h) * scale


def test_arguments_with_a_default_are_traced_at_it_and_other_values_refused():
    model = OptionalMask()
    layer_list = build_layer_list(model)
    x = torch.randn(3, 4)
    assert layer_list.adapter.pipe_inputs((x,), {"scale": 1.0, "mask": None}) == (x,)
    assert torch.equal(run_layers(layer_list, (x,)), model(x))
    with pytest.raises(UnsupportedModelError, match=r"traced for the pipeline with mask=None .* passes mask=a tensor "
                                                     r"of shape \(3, 4\); to pass mask, give it no default"):
        layer_list.adapter.pipe_inputs((x,), {"mask": torch.ones(3, 4)})
    with pytest.raises(UnsupportedModelError, match="with scale=1.0 .* passes scale=2.0"):
        layer_list.adapter.pipe_inputs((x, None, 2.0), {})


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.b(x) * (h > 0)  # h reaches the second layer but is used without gradient


def test_a_received_value_used_without_gradient_still_gets_one():
    layer_list = build_layer_list(Gate())
    second = layer_list.layers[1].entry
    assert isinstance(second, TracedLayer) and second.input_names == ("x", "a")
    x = torch.randn(3, 4, requires_grad=True)
    h = torch.randn(3, 4, requires_grad=True)  # as DeepSpeed receives it: a leaf needing a gradient
    second((x, h)).sum().backward()
    assert h.grad is not None and torch.equal(h.grad, torch.zeros(3, 4))  # DeepSpeed sends it back


def test_step_inputs_come_from_the_first_stage_objects_from_this_rank():
    model, other_model = object(), object()
    first = [((model, torch.arange(4.0), {"labels": torch.tensor([1, 2]), "n": 3}),
              {"flag": True, "shape": torch.Size([2, 3])})]
    encoded, payload = step_inputs.encode_calls(first)
    mine = [((other_model, torch.empty(0), None), {"flag": False})]
    (args, kwargs), = step_inputs.decode_calls(pickle.loads(pickle.dumps(encoded)), payload.clone(), mine)
    assert args[0] is other_model  # not sent: this rank's own
    assert torch.equal(args[1], torch.arange(4.0)) and torch.equal(args[2]["labels"], torch.tensor([1, 2]))
    assert args[2]["n"] == 3 and kwargs == {"flag": True, "shape": torch.Size([2, 3])}
    with pytest.raises(SMPRuntimeError, match=r"step argument #0 \(object on the first pipeline stage\) is missing "
                                              "on this stage: every stage must pass"):
        step_inputs.decode_calls(encoded, payload, [((), {})])


def test_step_inputs_keep_mappings_and_named_tuples():
    import collections

    Batch = collections.namedtuple("Batch", "ids labels")
    ordered = collections.OrderedDict(ids=torch.arange(3), mask=torch.ones(3))
    encoded, payload = step_inputs.encode_calls([((Batch(torch.arange(2), torch.tensor([5, 6])), ordered), {})])
    (args, _), = step_inputs.decode_calls(encoded, payload, [((torch.empty(0), torch.empty(0)), {})])
    assert type(args[0]) is Batch and torch.equal(args[0].labels, torch.tensor([5, 6]))
    assert type(args[1]) is collections.OrderedDict and list(args[1]) == ["ids", "mask"]
    assert torch.equal(args[1]["mask"], torch.ones(3))


class SkipInput(nn.Module):
    """The input data is used again after the cut: it crosses stages next to the activation."""

    def __init__(self):
        super().__init__()
        self.a, self.c, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.cat([self.c(torch.tanh(self.a(x))), x], dim=1))


def test_every_floating_value_a_layer_sends_accepts_a_gradient():
    """As DeepSpeed's non-last stage does: ``out.backward(grad)`` for each floating output it sent."""
    layer_list = build_layer_list(SkipInput())
    first = layer_list.layers[0].entry
    assert first.output_names == ("x", "tanh")
    x = torch.randn(3, 4)  # first-stage data: no gradient
    outputs = first((x,))
    for out in outputs:
        out.backward(torch.ones_like(out), retain_graph=True)
    assert layer_list.layers[0].entry.graph_module.a.weight.grad is not None


def test_a_tensor_passed_twice_is_sent_once():
    ids = torch.arange(1000)
    _, once = step_inputs.encode_calls([((ids,), {})])
    encoded, twice = step_inputs.encode_calls([((ids,), {"labels": ids})])
    assert twice.numel() == once.numel() == ids.numel() * ids.element_size()
    (args, kwargs), = step_inputs.decode_calls(encoded, twice, [((None,), {})])
    assert torch.equal(args[0], ids) and torch.equal(kwargs["labels"], ids)


def test_every_dtype_and_shape_travels_in_one_payload():
    """Mixed dtypes (bool, half, int64, 0-d, empty, non-contiguous) keep their bytes in one aligned buffer."""
    wide = torch.arange(12.0).reshape(3, 4)
    values = [torch.tensor([True, False, True]), torch.randn(5).half(), torch.tensor(7), torch.empty(0, 3),
              wide.t(), torch.arange(3, dtype=torch.int64)]
    encoded, payload = step_inputs.encode_calls([(tuple(values), {})])
    received = payload.clone()  # as a receiving stage holds it
    (args, _), = step_inputs.decode_calls(pickle.loads(pickle.dumps(encoded)), received, [((None,) * 6, {})])
    for sent, got in zip(values, args):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
        assert got.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()  # a view: no copy


class MaxAcross(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        best = torch.max(self.a(x), dim=1)  # a (values, indices) tuple, not a tensor
        return self.b(x) + best.values[:, None]


def test_a_non_tensor_crossing_layers_is_refused_at_run_time_with_its_name():
    layer_list = build_layer_list(MaxAcross())
    with pytest.raises(UnsupportedModelError, match=r"value 'max_1' crosses from one pipeline layer to a later one "
                                                     r"but is a max, not a tensor; only tensors travel"):
        run_layers(layer_list, (torch.randn(2, 4),))
