"""Pipeline pieces without processes: layer lists, cost balancing, manual placement, schedules,
topology mapping, configuration errors. Tiny models are also used by test_pipeline_dist.py."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from smp2ds.engine.pipeline import (
    PipelineSettings,
    UnsupportedModelError,
    build_layer_list,
    choose_schedule,
    clear_partitions,
    configure_partitions,
    partition,
    plan_for,
    plan_partition,
    set_partition,
)
from smp2ds.engine.pipeline.balance import balance, layer_costs, manual_parts
from smp2ds.engine.pipeline.families.probe import run_layers
from smp2ds.engine.pipeline.layers import compute_proxy
from smp2ds.translator.issues import SMPConfigError
from smp2ds.translator.topology import PLACEMENT_ALIASES, PLACEMENT_ORDERS, Topology

VOCAB, SEQ = 64, 8


# ---- tiny models (shared with the multi-rank tests) -------------------------------------------
def make_model(kind: str, seed: int = 0) -> nn.Module:
    """Tiny fp32 models with dropout off, identical for the same seed."""
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "seq":
        return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16),
                             nn.Tanh(), nn.Linear(16, 4))
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0))
    bert = {"num_hidden_layers": 4, "hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
            "vocab_size": VOCAB, "max_position_embeddings": 16, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}
    if kind == "bert_cls":
        return BertForSequenceClassification(BertConfig(num_labels=3, **bert))
    if kind == "bert_mlm":
        return BertForMaskedLM(BertConfig(**bert))
    if kind == "bert_qa":
        return BertForQuestionAnswering(BertConfig(**bert))
    if kind in ("llama", "llama_tied"):
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=16, num_attention_heads=2,
                                            num_key_value_heads=1, intermediate_size=32, vocab_size=VOCAB,
                                            max_position_embeddings=16, tie_word_embeddings=kind == "llama_tied"))
    raise ValueError(kind)


def _padded_batch(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    return ids, mask


# ---- layer lists -------------------------------------------------------------------------------
def test_question_answering_layer_list_reproduces_the_hf_outputs_and_loss_exactly():
    """BertForQuestionAnswering: start and end logits and the span loss, positions beyond the sequence ignored."""
    model = make_model("bert_qa").eval()
    layer_list = build_layer_list(model)
    assert layer_list.names[-1] == "qa_outputs"
    ids, mask = _padded_batch()
    spans = {"start_positions": torch.tensor([1, 4, 99]), "end_positions": torch.tensor([2, 6, 99])}
    for kwargs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask, **spans}):
        with torch.no_grad():
            ref = model(**kwargs)
            out = run_layers(layer_list, layer_list.adapter.pipe_inputs((), kwargs))
            wrapped = layer_list.adapter.make_output(out, (), kwargs)
        assert torch.equal(wrapped.start_logits, ref.start_logits) and torch.equal(wrapped.end_logits, ref.end_logits)
        if "start_positions" in kwargs:
            assert torch.equal(wrapped.loss, ref.loss)


@pytest.mark.parametrize("kind", ["gpt2", "bert_cls", "bert_mlm", "llama", "llama_tied"])
def test_layer_list_reproduces_the_hf_forward_and_loss_exactly(kind):
    model = make_model(kind).eval()
    layer_list = build_layer_list(model)
    ids, mask = _padded_batch()
    labels = torch.tensor([0, 2, 1]) if kind == "bert_cls" else ids
    for kwargs in ({"input_ids": ids}, {"input_ids": ids, "attention_mask": mask, "labels": labels}):
        with torch.no_grad():
            ref = model(**kwargs)
            out = run_layers(layer_list, layer_list.adapter.pipe_inputs((), kwargs))
            wrapped = layer_list.adapter.make_output(out, (), kwargs)
        assert torch.equal(wrapped.logits, ref.logits)
        if "labels" in kwargs:
            assert torch.equal(wrapped.loss, ref.loss)
    # return_dict=False gives HF's tuple order (loss, logits)
    tup = layer_list.adapter.make_output(out, (), {"input_ids": ids, "labels": labels, "return_dict": False})
    assert isinstance(tup, tuple) and torch.equal(tup[1], ref.logits)


def test_layer_names_and_tied_ends():
    from deepspeed.pipe import TiedLayerSpec

    gpt2 = build_layer_list(make_model("gpt2"))
    assert gpt2.names == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                          "transformer.h.2", "transformer.h.3", "transformer.ln_f", "lm_head"]
    ends = [gpt2.layers[0].entry, gpt2.layers[-1].entry]
    assert all(isinstance(e, TiedLayerSpec) for e in ends) and ends[0].key == ends[1].key
    mlm = build_layer_list(make_model("bert_mlm"))
    assert mlm.names[-3:] == ["cls.predictions.transform", "cls.predictions.decoder", "cls.predictions.bias"]
    assert isinstance(mlm.layers[0].entry, TiedLayerSpec) and isinstance(mlm.layers[-2].entry, TiedLayerSpec)
    untied = build_layer_list(make_model("llama"))
    assert not any(isinstance(layer.entry, TiedLayerSpec) for layer in untied.layers)
    tied_llama = build_layer_list(make_model("llama_tied"))
    assert isinstance(tied_llama.layers[-1].entry, TiedLayerSpec)
    seq = build_layer_list(make_model("seq"))
    assert seq.names == [str(i) for i in range(7)]


def test_unsupported_model_error_names_the_families_and_the_manual_route():
    with pytest.raises(UnsupportedModelError) as err:
        build_layer_list(nn.Linear(2, 2))
    text = str(err.value)
    for name in ("torch.nn.Sequential", "GPT2LMHeadModel", "BertForSequenceClassification", "BertForMaskedLM",
                 "LlamaForCausalLM", "smp.partition", "torch.nn.modules.linear.Linear"):
        assert name in text


def test_unsupported_call_arguments_are_named():
    layer_list = build_layer_list(make_model("gpt2"))
    ids, _ = _padded_batch()
    with pytest.raises(UnsupportedModelError, match=r"\['inputs_embeds'\].*supported: input_ids, attention_mask"):
        layer_list.adapter.pipe_inputs((), {"input_ids": ids, "inputs_embeds": torch.zeros(3, SEQ, 16)})
    seq = build_layer_list(make_model("seq"))
    with pytest.raises(UnsupportedModelError, match="exactly one positional input"):
        seq.adapter.pipe_inputs((torch.zeros(1, 12), torch.zeros(1, 12)), {})


# ---- cost model and balancing ---------------------------------------------------------------------
def _brute_force(costs, stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        parts = [0, *cuts, n]
        worst = max(sum(costs[parts[i]:parts[i + 1]]) for i in range(stages))
        best = worst if best is None else min(best, worst)
    return best


def test_balance_finds_the_optimal_contiguous_split():
    rng = random.Random(7)
    for _ in range(200):
        n, stages = rng.randint(2, 9), rng.randint(1, 4)
        if stages > n:
            continue
        costs = [rng.choice([0.0, rng.random(), rng.random() * 10]) for _ in range(n)]
        parts = balance(costs, stages)
        assert parts[0] == 0 and parts[-1] == n and all(parts[i] < parts[i + 1] for i in range(stages))
        worst = max(sum(costs[parts[i]:parts[i + 1]]) for i in range(stages))
        assert worst == pytest.approx(_brute_force(costs, stages), abs=1e-12)


def test_memory_weight_moves_the_split_between_memory_and_compute():
    # Layer 0 is big in memory but computes nothing (an embedding); the rest are compute-heavy.
    memory, compute = [100.0, 10.0, 10.0, 10.0], [0.0, 10.0, 10.0, 10.0]
    assert layer_costs(memory, compute, 1.0) == pytest.approx([100 / 130, 10 / 130, 10 / 130, 10 / 130])
    assert layer_costs(memory, compute, 0.0) == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3])
    assert balance(layer_costs(memory, compute, 1.0), 2) == [0, 1, 4]
    assert balance(layer_costs(memory, compute, 0.0), 2) == [0, 2, 4]


def test_compute_proxy_counts_dense_weights_twice_and_embeddings_not_at_all():
    assert compute_proxy(nn.Linear(3, 5)) == 2 * 15 + 5
    assert compute_proxy(nn.Embedding(10, 4)) == 0
    assert compute_proxy(nn.LayerNorm(4)) == 8
    gpt2 = build_layer_list(make_model("gpt2"))
    head = gpt2.layers[-1]
    assert head.flops == 2 * VOCAB * 16 and head.memory == VOCAB * 16 * 4  # tied copy held on the last stage
    assert gpt2.layers[0].flops == 0


def test_auto_plan_for_gpt2_and_its_description():
    plan = plan_partition(build_layer_list(make_model("gpt2")), 2, memory_weight=0.8)
    assert plan.method == "auto" and plan.parts[0] == 0 and plan.parts[-1] == 8
    assert sum(s.cost for s in plan.stages) == pytest.approx(1.0)
    text = plan.describe()
    assert text.startswith("pipeline split (auto, memory_weight=0.8): stage 0 = layers 0-")
    assert "lm_head" in text and plan.to_dict()["stages"][1]["last_layer"] == 7


# ---- manual placement ---------------------------------------------------------------------------------
def test_partition_context_and_set_partition_decide_the_stages():
    clear_partitions()
    with partition(0):
        first = [nn.Linear(4, 4), nn.ReLU()]
        with partition(1):  # innermost context wins
            inner = nn.Linear(4, 4)
    later = nn.Linear(4, 2)  # created outside: default_partition unless set_partition
    model = nn.Sequential(*first, inner, later)
    plan = plan_partition(build_layer_list(model), 2, auto=False, default_partition=1)
    assert plan.parts == (0, 2, 4) and plan.method == "manual"
    set_partition(model[2], 0)
    plan = plan_partition(build_layer_list(model), 2, auto=False, default_partition=1)
    assert plan.parts == (0, 3, 4)
    set_partition(model[3], 0)
    with pytest.raises(ValueError, match=r"partition\(s\) \[1\] received no layers"):
        plan_partition(build_layer_list(model), 2, auto=False, default_partition=1)
    set_partition(model[0], 1)
    with pytest.raises(ValueError, match=r"layer 1 \(1\) is on partition 0 but comes after layer 0 \(0\) on "
                                         r"partition 1"):
        plan_partition(build_layer_list(model), 2, auto=False, default_partition=1)
    clear_partitions()


def test_set_partition_on_hf_blocks_and_mixed_owners():
    clear_partitions()
    model = make_model("gpt2")
    for block in model.transformer.h[1:]:
        set_partition(block, 1)
    set_partition(model.transformer.ln_f, 1)
    set_partition(model.lm_head, 1)
    plan = plan_partition(build_layer_list(model), 2, auto=False, default_partition=0)
    assert plan.stages[1].layers == ("transformer.h.1", "transformer.h.2", "transformer.h.3", "transformer.ln_f",
                                     "lm_head")
    set_partition(model.transformer.drop, 1)  # wpe and drop form one layer
    with pytest.raises(ValueError, match=r"layer 1 \(transformer.wpe\) mixes modules assigned to partitions"):
        plan_partition(build_layer_list(model), 2, auto=False, default_partition=0)
    clear_partitions()


def test_partition_index_is_checked_against_the_degree():
    from smp2ds.engine.exceptions import InvalidPartitionIDError

    configure_partitions(2)
    try:
        with pytest.raises(InvalidPartitionIDError, match="partition index 2 is out of range"), partition(2):
            pass
        with pytest.raises(InvalidPartitionIDError):
            set_partition(nn.Linear(1, 1), -1)
    finally:
        configure_partitions(None)
    assert manual_parts([0, 0, 1], 2, ["a", "b", "c"]) == [0, 2, 3]


# ---- schedules ----------------------------------------------------------------------------------------
def test_schedule_choice_follows_smp_rules():
    assert choose_schedule("simple", 4, 4, 2).kind == "gpipe"
    forced = choose_schedule("simple", 8, 4, 2)
    assert forced.kind == "1f1b" and "forced to 'interleaved'" in forced.note
    assert choose_schedule("interleaved", 8, 2, 2).kind == "1f1b"
    small = choose_schedule("interleaved", 8, 1, 2)
    assert (small.kind, small.group_size, small.max_in_flight) == ("gpipe", 1, 1)


def _simulate(kind, m, stages, group):
    """Execute every stage's instruction stream with blocking (rendezvous) send/recv.

    Returns per-stage max micro-batches in flight; fails on deadlock or a lost/duplicated pass.
    """
    from deepspeed.runtime.pipe import schedule as S

    from smp2ds.engine.pipeline.schedules import make_train_schedule

    streams = [[c for step in make_train_schedule(kind, m, stages, s, group) for c in step] for s in range(stages)]
    pos, fwd, bwd, peak = [0] * stages, [0] * stages, [0] * stages, [0] * stages
    partner = {S.SendActivation: (1, S.RecvActivation), S.RecvActivation: (-1, S.SendActivation),
               S.SendGrad: (-1, S.RecvGrad), S.RecvGrad: (1, S.SendGrad)}
    while any(pos[s] < len(streams[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            if pos[s] >= len(streams[s]):
                continue
            cmd = streams[s][pos[s]]
            if type(cmd) in partner:
                step, want = partner[type(cmd)]
                o = s + step
                if pos[o] < len(streams[o]) and isinstance(streams[o][pos[o]], want):
                    pos[s] += 1
                    pos[o] += 1
                    moved = True
                continue
            assert not isinstance(cmd, S.OptimizerStep), "the optimizer step belongs to the caller"
            fwd[s] += isinstance(cmd, S.ForwardPass)
            bwd[s] += isinstance(cmd, S.BackwardPass)
            assert bwd[s] <= fwd[s]
            peak[s] = max(peak[s], fwd[s] - bwd[s])
            pos[s] += 1
            moved = True
        assert moved, f"deadlock: {kind} m={m} stages={stages} at {pos}"
    assert fwd == [m] * stages and bwd == [m] * stages
    for stream in streams:  # the reductions come once, after the last backward pass
        kinds = [type(c) for c in stream]
        assert kinds.count(S.ReduceTiedGrads) == kinds.count(S.ReduceGrads) == 1
        last_backward = max(i for i, k in enumerate(kinds) if k is S.BackwardPass)
        assert kinds.index(S.ReduceTiedGrads) > last_backward and kinds.index(S.ReduceGrads) > last_backward
    return peak


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_schedules_run_without_deadlock_and_respect_the_in_flight_cap(stages):
    for m in range(1, 9):
        for active in range(1, m + 1):
            choice = choose_schedule("interleaved", m, active, stages)
            peak = _simulate(choice.kind, m, stages, choice.group_size)
            assert max(peak) <= min(choice.max_in_flight, active), (m, active, peak)
            if choice.kind == "1f1b":  # DeepSpeed 1F1B: stage s holds at most min(pp - s, m)
                assert peak == [min(stages - s, m) for s in range(stages)]
        assert _simulate("gpipe", m, stages, m) == [m] * stages


def test_schedules_keep_only_the_requested_reductions():
    from deepspeed.runtime.pipe import schedule as S

    from smp2ds.engine.pipeline.schedules import make_train_schedule

    for kind in ("1f1b", "gpipe"):
        for reduce, expected in (("tied", [S.ReduceTiedGrads]), ("none", [])):
            cmds = [type(c) for step in make_train_schedule(kind, 4, 2, 0, 4, reduce) for c in step]
            assert [c for c in cmds if c in (S.ReduceTiedGrads, S.ReduceGrads, S.OptimizerStep)] == expected


# ---- topology -----------------------------------------------------------------------------------------
def test_deepspeed_topology_matches_smp_rank_order_for_every_placement():
    from smp2ds.engine.pipeline.ds_topology import to_ds_topology

    for placement in list(PLACEMENT_ALIASES) + list(PLACEMENT_ORDERS):
        for pp, tp, rdp in itertools.product((2, 3), (1, 2), (1, 2, 3)):
            smp = Topology(pp=pp, tp=tp, rdp=rdp, placement=placement)
            ds = to_ds_topology(smp)
            for r in range(smp.world_size):
                c, d = smp.coords(r), ds.get_coord(r)
                assert (d.pipe, d.data, d.model) == (c.pp_rank, c.rdp_rank, c.tp_rank), (placement, r)
            assert sorted(map(sorted, ds.get_axis_comm_lists("pipe"))) == sorted(map(sorted, smp.groups("pp")))
            assert sorted(map(sorted, ds.get_axis_comm_lists("data"))) == sorted(map(sorted, smp.groups("rdp")))


# ---- configuration ------------------------------------------------------------------------------------
def test_settings_errors_name_the_pointer_value_and_fix():
    with pytest.raises(SMPConfigError) as err:
        PipelineSettings.from_config({"pipeline_parallel_degree": 2, "microbatches": 4},
                                     {"zero_optimization": {"stage": 2}})
    issue = err.value.issues[0]
    assert issue.pointer == "/deepspeed/zero_optimization/stage" and issue.given == 2
    assert "ZeRO stage 2 cannot run with DeepSpeed's pipeline engine" in issue.message and "ZeRO-1" in issue.hint
    # The pipeline reads the translator's decisions, so misuse is reported by the translator,
    # every problem at once and with its pointer.
    with pytest.raises(SMPConfigError) as err:
        PipelineSettings.from_config({"partitions": 2, "microbatches": 2, "sharded_data_parallel_degree": 2,
                                      "auto_partition": False}, world_size=4)
    pointers = sorted(i.pointer for i in err.value.issues)
    assert pointers == ["/auto_partition", "/ddp", "/sharded_data_parallel_degree"], pointers
    with pytest.raises(SMPConfigError) as err:
        PipelineSettings.from_config({"partitions": 2, "microbatches": 2, "pipeline": "_only_forward"})
    assert [i.pointer for i in err.value.issues] == ["/pipeline"]
    assert "not supported" in err.value.issues[0].message


def test_settings_follow_the_plan_schedule_decision():
    plan = plan_for({"partitions": 2, "microbatches": 8, "active_microbatches": 1})
    s = PipelineSettings.from_plan(plan)
    assert plan.engine["pipeline"]["schedule"] == s.schedule.kind == "gpipe" and s.schedule.group_size == 1


def test_settings_resolve_defaults_and_zero1_is_fine():
    s = PipelineSettings.from_config({"partitions": 2, "microbatches": 8}, {"zero_optimization": {"stage": 1}})
    assert (s.pp, s.active_microbatches, s.schedule.kind, s.memory_weight) == (2, 4, "1f1b", 0.8)
    s = PipelineSettings.from_config({"pipeline_parallel_degree": 2, "microbatches": 4, "pipeline": "simple"})
    assert s.schedule.kind == "gpipe" and s.schedule.group_size == 4
