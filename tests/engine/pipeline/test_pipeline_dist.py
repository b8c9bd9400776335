"""Pipeline parallelism in real processes (gloo, CPU) against a single-process PyTorch reference.

Two spawned runs: pp=2 on 2 ranks and pp=2 x dp=2 on 4 ranks. Each trains tiny GPT-2, BERT (classification,
question answering, masked LM) and nn.Sequential models with both schedules (interleaved = 1F1B, simple = GPipe), 4 micro-batches,
through SMP-style step functions (``model(...)`` then ``model.backward(loss)``), and returns its
per-micro-batch losses, full and per-stage state dicts and placement facts. The reference runs the
same step functions on the plain model, each micro-batch loss scaled by 1/(microbatches x dp) as
SMP's gradient averaging does, on the union of the data-parallel ranks' batches.

SGD (momentum) for the transformer models: their attention key biases have gradients that are
zero up to float noise (softmax ignores a constant shift), and Adam turns that noise into
lr-sized steps, which would test Adam's amplification rather than the pipeline. Adam is used on
the nn.Sequential model, which has no such parameters.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import run_ranks
from tests.engine.pipeline.test_pipeline_units import SEQ, VOCAB, make_model

MICRO, PER_RANK, STEPS = 4, 8, 3
TOL = {"rtol": 1e-5, "atol": 1e-6}


# ---- SMP-style step functions (used unchanged by the pipeline and the reference) ---------------
def step_seq(model, x, y):
    out = model(x)
    loss = F.cross_entropy(out, y)
    model.backward(loss)
    return loss


def step_lm(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask, labels=ids)
    model.backward(out.loss)
    return out.loss


def step_cls(model, ids, mask, y):
    out = model(ids, attention_mask=mask, labels=y)
    model.backward(out.loss)
    return out.loss, out.logits


def step_qa(model, ids, mask, start, end):
    out = model(input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end)
    model.backward(out.loss)
    return out.loss, out.start_logits


def step_mlm(model, ids, labels):
    loss, _logits = model(input_ids=ids, labels=labels, return_dict=False)
    model.backward(loss)
    return loss


def eval_lm(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, labels=ids).loss


STEP_FNS = {"seq": step_seq, "gpt2": step_lm, "llama": step_lm, "bert_cls": step_cls, "bert_mlm": step_mlm,
            "bert_qa": step_qa}


def batch(kind: str, step: int, dp: int, vary: bool = False) -> tuple[torch.Tensor, ...]:
    """The global batch of one step (dp ranks x PER_RANK rows); rank r takes rows of block r.

    ``vary``: the sequence length changes from step to step (activation shapes change).
    """
    g = torch.Generator().manual_seed(100 + step)
    n = dp * PER_RANK
    seq = SEQ - 2 * (step % 2) if vary else SEQ
    if kind == "seq":
        return torch.randn(n, 12, generator=g), torch.randint(0, 4, (n,), generator=g)
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[::3, seq - 3:] = 0  # some padded rows
    if kind == "bert_cls":
        return ids, mask, torch.randint(0, 3, (n,), generator=g)
    if kind == "bert_qa":  # span ends inside the sequence, and one row's beyond it (ignored by the loss)
        start, end = torch.randint(0, seq // 2, (n,), generator=g), torch.randint(seq // 2, seq, (n,), generator=g)
        start[0] = end[0] = seq + 5
        return ids, mask, start, end
    if kind == "bert_mlm":
        labels = torch.where(torch.rand(n, seq, generator=g) < 0.3, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]  # every row has a target
        return ids, labels
    return ids, mask


def micro_calls(model, tensors, dp_rank: int) -> list:
    mine = [t[dp_rank * PER_RANK:(dp_rank + 1) * PER_RANK] for t in tensors]
    pieces = [t.chunk(MICRO) for t in mine]
    return [((model, *[p[i] for p in pieces]), {}) for i in range(MICRO)]


def make_optimizer(kind: str, params):
    if kind == "seq":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def loss_of(result) -> float:
    return float((result[0] if isinstance(result, tuple) else result).detach())


# ---- the worker -------------------------------------------------------------------------------------
class _ColumnMajorTanh(nn.Tanh):
    """Tanh whose output is a strided (column-major) view, as a stage output of a transposing layer is: the
    pipeline sends it to the next stage, and point-to-point sends refuse non-contiguous tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).t().contiguous().t()


def _seq_under_partition_contexts(strided: bool = False) -> nn.Module:
    """make_model('seq') built layer by layer under smp.partition contexts (same seed, same weights);
    ``strided``: the first stage's output is a non-contiguous view of the same values."""
    from smp2ds.engine.pipeline import partition

    torch.manual_seed(0)
    with partition(0):
        a = [nn.Linear(12, 16), _ColumnMajorTanh() if strided else nn.Tanh()]
    with partition(1):
        b = [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    return nn.Sequential(*a, *b)


def _manual_gpt2(model) -> None:
    from smp2ds.engine.pipeline import set_partition

    for module in (model.transformer.h[3], model.transformer.ln_f, model.lm_head):
        set_partition(module, 1)


def _train_case(case: dict) -> dict:
    import torch.distributed as dist

    from smp2ds.engine.pipeline import build_pipeline, clear_partitions, plan_for
    from smp2ds.translator.topology import Topology

    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.for_world(world, pp=2, placement=case.get("placement", "cluster"))
    kind, manual = case["kind"], case.get("manual")
    clear_partitions()
    model = (_seq_under_partition_contexts(manual == "strided") if manual in ("contexts", "strided")
             else make_model(kind))
    if manual == "set_partition":
        _manual_gpt2(model)
    cfg = {"pipeline_parallel_degree": 2, "microbatches": MICRO, "pipeline": case["pipeline"], "ddp": True,
           "placement_strategy": topo.placement, "auto_partition": manual is None}
    if case.get("active") is not None:
        cfg["active_microbatches"] = case["active"]
    if manual:
        cfg["default_partition"] = 0
    ds_config = {"gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
                 "zero_optimization": {"stage": case.get("zero", 0)}}
    runner = build_pipeline(model, plan_for(cfg, world, ds_config), topo)
    runner.attach_optimizer(make_optimizer(kind, model.parameters()))
    dp_rank = topo.coords(rank).rdp_rank
    losses, everywhere = [], []
    for step in range(STEPS):
        windows = [2 * step, 2 * step + 1] if case.get("accumulate") else [step]
        per_step = []
        for i, data_step in enumerate(windows):
            data = batch(kind, data_step, topo.rdp, case.get("vary", False))
            results = runner.run_step(STEP_FNS[kind], micro_calls(runner, data, dp_rank),
                                      reduce_grads=i == len(windows) - 1)
            per_step += [loss_of(r) for r in results]
            everywhere.append([float(x) for x in runner.last_losses])
        runner.optimizer_step()
        losses.append(per_step)
    out = {"rank": rank, "stage": runner.stage, "dp_rank": dp_rank, "losses": losses, "last_losses": everywhere,
           "schedule": runner.settings.schedule.kind, "split": runner.partition.describe(),
           "local_keys": sorted(runner.local_state_dict()),
           "local_modules": [_path(model, m) for m in runner.local_modules()],
           "state": {k: v.numpy() for k, v in runner.state_dict().items()},
           "engine_optimizer": type(runner.optimizer).__name__,
           "unique_numel": sum(p.numel() for _, p in runner.local_named_parameters(include_replicas=False))}
    if case.get("probe"):
        out["errors"] = _misuse_errors(runner, model)
    if kind == "gpt2":
        local = runner.local_state_dict()
        out["tied"] = {k: local[k].numpy() for k in ("transformer.wte.weight", "lm_head.weight") if k in local}
        runner.eval()
        out["eval"] = [float(r) for r in runner.run_step(eval_lm, micro_calls(runner, batch(kind, 99, topo.rdp),
                                                                                 dp_rank))]
        runner.train()
    return out


def _misuse_errors(runner, model) -> list[str]:
    """SMP's errors for calls outside a step, and the optimizer attached too late."""
    errors = []
    for call in (lambda: runner(torch.zeros(2, 12)), lambda: runner.backward(torch.zeros(())),
                 lambda: runner.attach_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))):
        try:
            call()
            errors.append("no error")
        except Exception as exc:  # noqa: BLE001 - the test inspects the class and text
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def _path(model, module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _run_cases(cases: list) -> list:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=os.environ["SMP2DS_INIT_METHOD"], rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        return [_train_case(case) for case in cases]
    finally:
        dist.destroy_process_group()


# ---- the reference ---------------------------------------------------------------------------------
class _Plain:
    """Stands in for the DistributedModel in the reference: backward scales like SMP averaging."""

    def __init__(self, model, scale):
        self.model, self.scale = model, scale

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss):
        (loss * self.scale).backward()


def reference(case: dict, dp: int) -> dict:
    kind = case["kind"]
    model = make_model(kind)
    opt = make_optimizer(kind, model.parameters())
    plain = _Plain(model, 1.0 / (MICRO * dp))
    losses = []  # losses[step][dp_rank] = per-micro-batch losses
    for step in range(STEPS):
        windows = [2 * step, 2 * step + 1] if case.get("accumulate") else [step]
        per_rank = [[] for _ in range(dp)]
        for data_step in windows:
            tensors = batch(kind, data_step, dp, case.get("vary", False))
            for r in range(dp):
                per_rank[r] += [loss_of(STEP_FNS[kind](*args)) for args, _ in micro_calls(plain, tensors, r)]
        opt.step()
        opt.zero_grad()
        losses.append(per_rank)
    out = {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if kind == "gpt2":
        model.eval()
        with torch.no_grad():
            tensors = batch(kind, 99, dp)
            out["eval"] = [[float(eval_lm(*args)) for args, _ in micro_calls(plain, tensors, r)] for r in range(dp)]
    return out


def check_case(case: dict, per_rank: list[dict], dp: int) -> None:
    ref = reference(case, dp)
    label = f"{case} rank"
    for res in per_rank:
        expected = [ref["losses"][s][res["dp_rank"]] for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(expected), **TOL, msg=f"{label} losses")
        flat = [x for step in res["losses"] for x in step]
        torch.testing.assert_close(torch.tensor(res["last_losses"]).flatten(), torch.tensor(flat), **TOL)
        assert set(res["state"]) == set(ref["state"])
        for key, value in ref["state"].items():
            torch.testing.assert_close(torch.from_numpy(res["state"][key]), value, **TOL, msg=f"{label} {key}")
        if "eval" in ref:
            torch.testing.assert_close(torch.tensor(res["eval"]), torch.tensor(ref["eval"][res["dp_rank"]]), **TOL)
    # Without replicas each weight counts on one stage only (a norm over stages counts it once).
    stage_numel = {res["stage"]: res["unique_numel"] for res in per_rank}
    assert sum(stage_numel.values()) == sum(p.numel() for p in make_model(case["kind"]).parameters())
    # Each stage holds its own layers only; together the stages hold the whole model.
    by_stage = {res["stage"]: set(res["local_keys"]) for res in per_rank}
    assert by_stage[0] | by_stage[1] == set(ref["state"])
    shared = by_stage[0] & by_stage[1]
    assert shared == ({"transformer.wte.weight", "lm_head.weight"} if case["kind"] == "gpt2" else
                      {"bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"}
                      if case["kind"] == "bert_mlm" else set())


CASES_PP2 = [
    {"kind": "seq", "pipeline": "interleaved", "probe": True},
    {"kind": "seq", "pipeline": "simple"},
    {"kind": "gpt2", "pipeline": "interleaved"},
    {"kind": "gpt2", "pipeline": "simple"},
    {"kind": "bert_cls", "pipeline": "interleaved"},
    {"kind": "bert_cls", "pipeline": "simple"},
    {"kind": "bert_mlm", "pipeline": "interleaved"},
    {"kind": "bert_qa", "pipeline": "interleaved"},
    {"kind": "llama", "pipeline": "simple"},
    {"kind": "llama", "pipeline": "interleaved", "vary": True},
    {"kind": "seq", "pipeline": "interleaved", "active": 1},
    {"kind": "gpt2", "pipeline": "interleaved", "manual": "set_partition"},
    {"kind": "seq", "pipeline": "simple", "manual": "contexts"},
    {"kind": "seq", "pipeline": "interleaved", "manual": "strided"},
]

CASES_PP2_DP2 = [
    {"kind": "seq", "pipeline": "interleaved", "placement": "PDT", "accumulate": True},
    {"kind": "seq", "pipeline": "simple", "placement": "spread"},
    {"kind": "gpt2", "pipeline": "interleaved", "placement": "cluster", "zero": 1},
    {"kind": "gpt2", "pipeline": "simple", "placement": "spread"},
    {"kind": "bert_cls", "pipeline": "interleaved", "placement": "spread", "zero": 1},
    {"kind": "bert_cls", "pipeline": "simple", "placement": "cluster"},
    {"kind": "bert_qa", "pipeline": "simple", "placement": "spread"},
]


@pytest.mark.slow
def test_pp2_on_two_ranks_matches_single_process_training():
    results = run_ranks(_run_cases, 2, CASES_PP2)
    for i, case in enumerate(CASES_PP2):
        per_rank = [results[r][i] for r in range(2)]
        check_case(case, per_rank, dp=1)
        assert [res["stage"] for res in per_rank] == [0, 1]
        expected_schedule = "gpipe" if case["pipeline"] == "simple" or case.get("active") == 1 else "1f1b"
        assert per_rank[0]["schedule"] == expected_schedule
    # Tied embedding: the first stage's wte and the last stage's copy are bit-identical after training.
    for i, case in enumerate(CASES_PP2):
        if case["kind"] == "gpt2":
            first, last = results[0][i]["tied"], results[1][i]["tied"]
            assert (first["transformer.wte.weight"] == last["lm_head.weight"]).all()
            assert (first["transformer.wte.weight"] != make_model("gpt2").transformer.wte.weight.detach()
                    .numpy()).any()  # and it did train
    for res in results:
        fwd, bwd, late = res[0]["errors"]
        assert fwd.startswith("FwdExecutionNotInStepFnError: with pipeline_parallel_degree > 1")
        assert bwd.startswith("BwdExecutionNotInStepFnError: model.backward must be called inside")
        assert late == "SMPRuntimeError: the optimizer must be attached before the first step"
    # Manual placement puts the named modules on the named stage.
    manual = {c.get("manual"): i for i, c in enumerate(CASES_PP2) if c.get("manual")}
    gpt2_stage1 = results[1][manual["set_partition"]]["local_modules"]
    assert gpt2_stage1 == ["transformer.h.3", "transformer.ln_f", "lm_head"]
    assert "transformer.h.2" in results[0][manual["set_partition"]]["local_modules"]
    assert results[0][manual["contexts"]]["local_modules"] == ["0", "1"]
    assert results[1][manual["contexts"]]["local_modules"] == ["2", "3", "4", "5", "6"]
    assert results[0][manual["contexts"]]["split"].startswith("pipeline split (manual): stage 0 = layers 0-1")


@pytest.mark.slow
def test_pp2_by_dp2_on_four_ranks_matches_single_process_training():
    results = run_ranks(_run_cases, 4, CASES_PP2_DP2)
    from smp2ds.translator.topology import Topology

    for i, case in enumerate(CASES_PP2_DP2):
        per_rank = [results[r][i] for r in range(4)]
        check_case(case, per_rank, dp=2)
        topo = Topology.for_world(4, pp=2, placement=case["placement"])
        assert [(res["stage"], res["dp_rank"]) for res in per_rank] == [
            (topo.coords(r).pp_rank, topo.coords(r).rdp_rank) for r in range(4)]
        if case.get("zero") == 1:
            assert per_rank[0]["engine_optimizer"] == "DeepSpeedZeroOptimizer"
