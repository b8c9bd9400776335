"""The memory estimate's parts, each against something it can be wrong about (one process, no ranks).

The fake-tensor trace sees what a real step allocates; the parts it adds by formula are DeepSpeed's documented
allocations; pipelines, tensor parallelism and activation checkpointing change the roles the way the engine
does. The multi-rank check against measured peaks is ``test_memory_estimate_dist.py``.
"""

from __future__ import annotations

import contextlib
import gc
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import GPT2Config, GPT2LMHeadModel

from smp2ds.engine.memory import estimate_memory, load_model_source
from smp2ds.engine.memory.estimate import CONTEXT_BYTES, StepShape, usable_bytes
from smp2ds.engine.memory.measure import LiveTensorBytes
from smp2ds.engine.memory.model_source import hf_inputs
from smp2ds.engine.memory.model_states import model_states
from smp2ds.engine.memory.step_trace import trace_step
from smp2ds.translator.tools.device_memory import device_bytes

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4,
        "vocab_size": 1000, "n_positions": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
MIB = 1 << 20


@pytest.fixture
def gpt2_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GPT2))
    return str(tmp_path)


def _gpt2() -> GPT2LMHeadModel:
    fields = {k: v for k, v in GPT2.items() if k not in ("model_type", "architectures")}
    return GPT2LMHeadModel(GPT2Config(**fields)).train()


@pytest.mark.parametrize("fake", [True, False])
def test_the_fake_trace_sees_what_the_real_step_holds(fake):
    torch.manual_seed(0)
    traces = []
    for mode in (FakeTensorMode() if fake else contextlib.nullcontext(), contextlib.nullcontext()):
        with mode:
            model = _gpt2()
            inputs = hf_inputs(model, 2, 32)
            traces.append(trace_step(lambda: model(**inputs).loss, [model]))  # noqa: B023 - called at once
    assert traces[0] == traces[1]
    assert traces[0].saved_activations > 0 and traces[0].gradients == traces[0].parameters


def test_the_estimate_lands_within_ten_percent_of_an_independent_count_of_a_real_step(gpt2_dir):
    """One process, plain torch Adam: the traced parts plus Adam's moments against the live-storage counter
    (which installs no hooks and shares no code with the tracer)."""
    estimate = estimate_memory(load_model_source(gpt2_dir), StepShape(batch_per_rank=4, seq_len=64))
    role = estimate.roles[0]
    moments = next(p.bytes for p in role.parts if p.name == "Adam moments")
    expected = role.backward_peak  # params, grads, activations, transient and the moments (held through the step)
    torch.manual_seed(0)
    counter = LiveTensorBytes()
    with counter:
        model = _gpt2()
        optimizer = torch.optim.Adam(model.parameters(), foreach=False)
        inputs = hf_inputs(model, 4, 64)
        for _ in range(2):
            gc.collect()
            optimizer.zero_grad(set_to_none=False)
            out = model(**inputs)
            out.loss.backward()
            optimizer.step()
            del out
    assert moments == 8 * sum(p.numel() for p in model.parameters())
    assert abs(expected / counter.peak - 1) < 0.10, (expected / MIB, counter.peak / MIB)


def test_zero1_shards_the_optimizer_and_allocates_its_bucket_whole():
    common = {"elements": 1000, "grad_bytes_per_element": 2, "half": True}
    ddp_parts, ddp_buckets = model_states(zero_stage=0, shard=1, zero_config={}, **common)
    assert {p.name: p.bytes for p in ddp_parts} == {"Adam moments": 8000, "fp32 master copy": 4000,
                                                   "fp32 gradients": 4000}
    assert [b.bytes for b in ddp_buckets] == [2000]  # one bucket of at most all the gradients
    parts, buckets = model_states(zero_stage=1, shard=4, zero_config={"reduce_bucket_size": 500}, **common)
    assert sum(p.bytes for p in parts) == 16 * 1000 // 4
    assert [b.bytes for b in buckets] == [500 * 2]
    _, overlapped = model_states(zero_stage=1, shard=4, zero_config={"overlap_comm": True}, **common)
    assert overlapped[0].bytes == 2 * int(5e8) * 2
    _, none = model_states(zero_stage=1, shard=4, zero_config={"contiguous_gradients": False}, **common)
    assert none == []
    with pytest.raises(ValueError, match="stages 0 and 1"):
        model_states(zero_stage=3, shard=4, zero_config={}, **common)


def _sdp(source, shard: int, **zero: int):
    config = {"stage3_param_persistence_threshold": 1000, **zero}
    return estimate_memory(source, StepShape(batch_per_rank=4, seq_len=64, zero_stage=3, optimizer_shard=shard,
                                              zero_config=config)).roles[0]


def test_sharded_data_parallelism_partitions_the_model_states_and_gathers_the_parameters(gpt2_dir):
    """ZeRO-3 over the shard group: 1/S of the parameters, gradients and optimizer state (every partition padded),
    parameters over the persistence threshold whole only while gathered (all of this small model: they are reused
    within max_reuse_distance), no gradient held before backward."""
    source = load_model_source(gpt2_dir)
    ddp = estimate_memory(source, StepShape(batch_per_rank=4, seq_len=64)).roles[0]
    with FakeTensorMode():
        sizes = [p.numel() for p in _gpt2().parameters()]
    big = [n for n in sizes if n > 1000]
    for shard in (2, 4):
        role = _sdp(source, shard)
        partition = sum(-(-n // shard) for n in sizes)
        assert role.elements == partition and role.gradients == 4 * partition
        persistent = 4 * sum(n for n in sizes if n <= 1000)
        assert role.parameters == 4 * partition + persistent  # GPT-2 has no buffers here
        parts = {p.name: p for p in role.parts}
        assert parts["Adam moments"].bytes == 8 * partition and parts["fp32 master partition"].bytes == 4 * partition
        assert parts["gathered parameters"].bytes == 4 * sum(big)
        assert role.transient >= parts["gathered parameters"].bytes
        assert role.activations == ddp.activations
        assert role.total < ddp.total
    assert _sdp(source, 4).total < _sdp(source, 2).total
    # a short reuse distance and few live parameters: the running layer and the prefetch only
    capped = {p.name: p.bytes for p in _sdp(source, 2, stage3_max_reuse_distance=0, stage3_max_live_parameters=0,
                                             stage3_prefetch_bucket_size=0).parts}
    assert capped["gathered parameters"] == 4 * max(big)  # the tied embedding is the largest layer


def test_sharded_data_parallelism_reduces_whole_gradients_in_buckets(gpt2_dir):
    """The reduce bucket holds whole gradients until reduce_bucket_size elements arrive; the last one is reduce-
    scattered when backward ends through a flat copy (two on gloo)."""
    source = load_model_source(gpt2_dir)
    role = _sdp(source, 2)
    parts = {p.name: p for p in role.parts}
    whole = 4 * sum(p.numel() for p in _gpt2().parameters())
    assert parts["last reduce bucket"].bytes == whole == parts["reduce-scatter copies"].bytes
    assert parts["last reduce bucket"].phase == "reduce" and role.reduce_peak > 0
    small = {p.name: p.bytes for p in _sdp(source, 2, reduce_bucket_size=1000).parts}
    assert small["last reduce bucket"] == 4 * (1000 + GPT2["vocab_size"] * GPT2["n_embd"])  # a bucket and a parameter
    gloo = estimate_memory(source, StepShape(batch_per_rank=4, seq_len=64, zero_stage=3, optimizer_shard=2,
                                             backend="gloo")).roles[0]
    assert {p.name: p.bytes for p in gloo.parts}["reduce-scatter copies"] == 2 * whole


def test_pipeline_roles_hold_their_stage_and_the_micro_batches_in_flight(gpt2_dir):
    source = load_model_source(gpt2_dir)
    whole = estimate_memory(source, StepShape(batch_per_rank=4, seq_len=64, microbatches=4))
    piped = estimate_memory(source, StepShape(pipeline_stages=2, batch_per_rank=4, seq_len=64, microbatches=4))
    assert [r.in_flight for r in piped.roles] == [2, 1]
    assert piped.roles[0].layers[0] == "transformer.wte" and piped.roles[1].layers[1] == "lm_head"
    tied = GPT2["vocab_size"] * GPT2["n_embd"]  # the tied embedding lives on both ends
    assert sum(r.elements for r in piped.roles) == whole.roles[0].elements + tied
    assert all(r.parameters < whole.roles[0].parameters for r in piped.roles)


def test_activation_checkpointing_keeps_less(gpt2_dir):
    source = load_model_source(gpt2_dir)
    plain = estimate_memory(source, StepShape(batch_per_rank=4, seq_len=64))
    ckpt = estimate_memory(source, StepShape(batch_per_rank=4, seq_len=64, activation_checkpointing=True))
    assert ckpt.roles[0].activations < plain.roles[0].activations / 2
    assert ckpt.roles[0].parameters == plain.roles[0].parameters


def test_tensor_parallelism_cuts_the_blocks_as_the_engine_does(gpt2_dir):
    """GPT-2 at tp 2: each block's projections hold half their weights and column biases; norms, row biases,
    embeddings and head stay whole. With SMP's default ``prescaled_batch: false`` each block runs the group's two
    batches (gathered), so it keeps more activations than one rank alone; prescaled, the group shares one."""
    source = load_model_source(gpt2_dir)
    one = estimate_memory(source, StepShape(batch_per_rank=2, seq_len=32)).roles[0]
    gathered = estimate_memory(source, StepShape(tensor_parallel=2, batch_per_rank=2, seq_len=32)).roles[0]
    shared = estimate_memory(source, StepShape(tensor_parallel=2, batch_per_rank=2, seq_len=32,
                                               prescaled_batch=True)).roles[0]
    h, layers = GPT2["n_embd"], GPT2["n_layer"]
    cut = layers * (h * 3 * h + 3 * h + h * h + h * 4 * h + 4 * h + 4 * h * h) // 2  # halves: weights, column biases
    assert one.elements - gathered.elements == cut == one.elements - shared.elements
    assert shared.activations < one.activations < gathered.activations


def test_tensor_parallelism_replaces_other_models_layers_as_the_engine_does(tmp_path):
    """Qwen2 has no in-place sharding rule: the engine replaces its nn.Linear / nn.Embedding layers by smp.nn
    modules over the tensor-parallel group, each holding 1/tp of its weight (the norms stay whole)."""
    qwen = tmp_path / "qwen.json"
    qwen.write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 32,
                                "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "num_hidden_layers": 1, "vocab_size": 100, "tie_word_embeddings": False}))
    from smp2ds.engine.nn.parallel import context

    source = load_model_source(str(qwen))
    active = context.resolve()
    drawn = active.tp.rng.init_generator().initial_seed()  # the process stream's next draw, taken
    one = estimate_memory(source, StepShape(batch_per_rank=2, seq_len=8)).roles[0]
    two = estimate_memory(source, StepShape(tensor_parallel=2, batch_per_rank=2, seq_len=8)).roles[0]
    norms = 3 * 32  # input, post-attention and final RMSNorm weights
    assert two.elements == (one.elements - norms) // 2 + norms
    assert two.activations > one.activations  # prescaled_batch false: each layer runs both ranks' batches
    # the cut ran in its own context: the process's context and stream are as they were
    assert context.resolve() is active
    assert active.tp.rng.init_generator().initial_seed() == drawn + 1


def test_layouts_it_cannot_estimate_are_refused_with_the_reason(tmp_path, gpt2_dir):
    from smp2ds.engine.memory.step_shape import step_shape
    from smp2ds.translator.normalize import normalize
    from smp2ds.translator.plan_types import Layout
    from smp2ds.translator.planner import plan

    layout = Layout(world_size=4)
    sdp = plan(normalize({"sharded_data_parallel_degree": 2, "ddp": True}, layout), layout)
    shape = step_shape(sdp, batch_per_rank=2, seq_len=32, activation_checkpointing=False)
    assert (shape.zero_stage, shape.optimizer_shard, shape.replicas) == (3, 2, 2)
    with pytest.raises(ValueError, match="sharded data parallelism with pipeline stages"):
        estimate_memory(load_model_source(gpt2_dir), StepShape(pipeline_stages=2, microbatches=2, batch_per_rank=2,
                                                               seq_len=8, zero_stage=3, optimizer_shard=2))
    with pytest.raises(ValueError, match="neither a config.json"):
        load_model_source(str(tmp_path / "missing"))


def test_device_sizes_and_names():
    assert device_bytes("80GiB")[0] == 80 << 30
    assert device_bytes("40GB")[0] == 40 * 1000**3
    assert device_bytes("24")[0] == 24 << 30
    assert device_bytes("H100")[0] == 81559 * MIB
    assert device_bytes("ml.p4d.24xlarge")[0] == 40960 * MIB
    with pytest.raises(ValueError, match="known GPU"):
        device_bytes("tpu-v5")
    assert usable_bytes(80 << 30) == int(((80 << 30) - CONTEXT_BYTES) * 0.95)


@pytest.mark.parametrize("precision", [{"bf16": True}, {}], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sharding", [{}, {"shard_optimizer_state": True}], ids=["ddp", "zero1"])
def test_explain_params_and_explain_memory_count_the_same_model_state_bytes(precision, sharding):
    """``explain --params`` (the traffic model's per-rank model states) and ``explain --memory`` (the formula parts
    plus the traced parameters and gradients) agree for the same slice: one table of bytes per parameter."""
    from smp2ds.translator.normalize import normalize
    from smp2ds.translator.plan_types import Layout
    from smp2ds.translator.planner import plan
    from smp2ds.translator.tools.estimate import estimate

    layout = Layout(world_size=4, gpus_per_node=4)
    the_plan = plan(normalize({"ddp": True, **precision, **sharding}, layout), layout)
    params = 10_000_000
    scheme = estimate(the_plan, params)
    per_rank = scheme["schemes"][scheme["selected"]]["memory_bytes_per_rank"]
    width = 2 if precision else 4
    optimizer, _ = model_states(elements=params, grad_bytes_per_element=width, half=bool(precision),
                                zero_stage=1 if sharding else 0, shard=4, zero_config={})
    assert per_rank == 2 * width * params + sum(part.bytes for part in optimizer)
    assert per_rank == {("bf16", "ddp"): 20, ("fp32", "ddp"): 16, ("bf16", "zero1"): 4 + 16 / 4,
                        ("fp32", "zero1"): 8 + 16 / 4}[("bf16" if precision else "fp32",
                                                        "zero1" if sharding else "ddp")] * params
