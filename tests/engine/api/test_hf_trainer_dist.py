"""Hugging Face ``Trainer``'s SMP code path (transformers 4.57 and 5.x) on smp2ds: 2 real processes, gloo.

The environment says "SageMaker model parallel" exactly as SageMaker would
(``SM_HP_MP_PARAMETERS`` with ``partitions``, ``SM_FRAMEWORK_PARAMS`` with
``sagemaker_mpi_enabled``), so transformers' ``is_sagemaker_mp_enabled()`` is True, it imports
``smdistributed.modelparallel.torch`` (ours) and calls ``smp.init()``, wraps the model in
``smp.DistributedModel``, trains through ``trainer_pt_utils.smp_forward_backward`` and saves
through ``smp.save``. The workers use the stock ``Trainer`` and ``TrainingArguments`` (without
``use_cpu``: the machine has no CUDA); importing ``smdistributed`` installed the repairs
transformers' SMP path needs (``smp2ds.engine.api.hf_trainer_repairs``). The script-level
test of the same path (``use_cpu=True``, torchrun) is ``tests/scripts/test_hf_trainer_scripts.py``.

Every run is compared with a single-process plain-PyTorch reference that consumes the same
samples per optimizer step: accelerate hands the per-device batches of the sequential sampler to
the ranks round-robin, so step ``s`` sees the contiguous samples ``[s*N, (s+1)*N)`` with
``N = per_device_batch * gradient_accumulation_steps * world``; all sequences have the same
length, so the mean of the per-micro-batch, per-rank mean losses is the plain mean loss. The
sequential sampler is ``train_sampling_strategy="sequential"`` on 5.x; 4.57 has no such argument
(its Trainer always shuffles), so there the workers' ``Trainer`` returns the same
``SequentialSampler`` from ``_get_train_sampler``.

Adam's epsilon is 1e-4 instead of 1e-8: the attention key bias of GPT-2 has an analytically zero
gradient (softmax ignores a shift of all scores), so its gradient is float rounding noise whose
sign depends on summation order; with eps=1e-8 Adam turns that noise into full ``lr``-sized
steps and the comparison would measure the noise. eps=1e-4 mutes it and leaves Adam's
normalisation of every real gradient (here 1e-4 .. 1e-1) in place.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest

from tests._dist import run_ranks

pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (pip install accelerate)")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

TIMEOUT_S = float(os.environ.get("SMP2DS_TEST_TIMEOUT", "300"))
WORLD = 2
PER_DEVICE = 4
MICROBATCHES = 2
SEQ = 8
VOCAB = 64
LR = 1e-2
ADAM_EPS = 1e-4
MAX_GRAD_NORM = 1.0


# ---- shared by the workers and the reference -------------------------------------------------
def _model() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return GPT2LMHeadModel(config)


def _tokens(n: int, seed: int) -> Any:
    import torch

    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


class _LMData:
    """Map-style dataset of causal-LM examples (labels = inputs; the model shifts them)."""

    def __init__(self, tokens: Any):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


TRAIN = (64, 1)  # (samples, seed)
EVAL = (16, 2)


def _env(partitions: int = 1, **smp: Any) -> dict[str, str]:
    params = {"partitions": partitions, "microbatches": MICROBATCHES, "ddp": True, **smp}
    return {"SM_HP_MP_PARAMETERS": json.dumps(params),
            "SM_FRAMEWORK_PARAMS": json.dumps({"sagemaker_mpi_enabled": True}),
            "SMP2DS_ALLOW_CPU_FP16": "1"}


def _numpy(sd: dict) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in sd.items()}


# ---- workers (run in the spawned ranks) -------------------------------------------------------
def _sequential_trainer() -> tuple[type, dict]:
    """The Trainer class and TrainingArguments keywords that read the training set in order."""
    import inspect

    import torch
    from transformers import Trainer, TrainingArguments

    if "train_sampling_strategy" in inspect.signature(TrainingArguments).parameters:  # 5.x
        return Trainer, {"train_sampling_strategy": "sequential"}

    class SequentialTrainer(Trainer):  # 4.57: what 5.x's "sequential" strategy returns
        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None
                                                      else self.train_dataset)

    return SequentialTrainer, {}


def _train_worker(opts: dict) -> dict:
    import torch
    from transformers import TrainingArguments
    from transformers.training_args import ParallelMode

    import smdistributed.modelparallel.torch as smp

    trainer_class, sampling = _sequential_trainer()
    args = TrainingArguments(
        output_dir=opts["out"], per_device_train_batch_size=PER_DEVICE, per_device_eval_batch_size=PER_DEVICE,
        gradient_accumulation_steps=opts.get("gas", 1), max_steps=opts["steps"], learning_rate=opts.get("lr", LR),
        optim=opts.get("optim", "adamw_torch"), adam_epsilon=ADAM_EPS, weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM,
        lr_scheduler_type=opts.get("schedule", "constant"), logging_steps=1, report_to=[], seed=0,
        **sampling, disable_tqdm=True, dataloader_pin_memory=False,
        save_strategy="steps" if opts.get("save_steps") else "no", save_steps=opts.get("save_steps") or 500)
    model, optimizers = _model(), (None, None)
    if opts.get("user_optimizer"):
        optimizers = (torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, weight_decay=0.0), None)
    trainer = trainer_class(model=model, args=args, train_dataset=_LMData(_tokens(*TRAIN)), optimizers=optimizers)
    trainer.train(resume_from_checkpoint=opts.get("resume"))
    inner = trainer.optimizer.optimizer
    result = {
        "weights": _numpy(trainer.model_wrapped.state_dict()),  # the full model, as save_model takes it
        "param_dtype": str(next(trainer.model.parameters()).dtype),
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "world_size": args.world_size, "process_index": args.process_index, "device": str(args.device),
        "smp_mode": args.parallel_mode == ParallelMode.SAGEMAKER_MODEL_PARALLEL, "fp16": bool(args.fp16),
        "wrapped": isinstance(trainer.model_wrapped, smp.DistributedModel),
        "distributed_optimizer": isinstance(trainer.optimizer, smp.DistributedOptimizer),
        # Adam's step counters: they prove whether the optimizer state was restored on resume.
        "adam_steps": sorted({int(s["step"]) for s in inner.state.values() if "step" in s}),
    }
    if opts.get("eval"):
        result["eval_loss"] = trainer.evaluate(_LMData(_tokens(*EVAL)))["eval_loss"]
    if opts.get("final"):
        trainer.save_model(opts["final"])
    smp.barrier()
    return result


def _pt_utils_worker() -> dict:
    import torch

    import smdistributed.modelparallel.torch as smp

    smp.init()
    from transformers.trainer_pt_utils import (
        smp_forward_backward,
        smp_forward_only,
        smp_gather,
        smp_nested_concat,
    )

    rank = smp.rank()
    model = smp.DistributedModel(_model())
    smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = _tokens(WORLD * PER_DEVICE, 3)[rank * PER_DEVICE:(rank + 1) * PER_DEVICE]
    model.train()
    loss_mb = smp_forward_backward(model, {"input_ids": x, "labels": x}, 2)
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        out = smp_forward_only(model, {"input_ids": x})
    # prediction_step's shape of the call: the outputs except the ignored cache, as a tuple
    # (transformers 5.2x names the cache "cache" and ignores it by default; older releases
    # named it "past_key_values")
    logits_mb = tuple(v for k, v in out.items() if k not in ["cache", "past_key_values", "loss"])
    gathered = smp_gather((torch.tensor(float(rank)), {"m": torch.full((2, 3), float(rank))}))
    return {"mb_losses": [float(t) for t in loss_mb.outputs], "reduce_mean": float(loss_mb.reduce_mean()),
            "grads": grads, "logits": smp_nested_concat(logits_mb)[0].numpy(),
            "gathered_scalar": gathered[0].numpy(), "gathered_matrix": gathered[1]["m"].numpy()}


# ---- the plain PyTorch reference -----------------------------------------------------------------
def _reference(steps: int, gas: int = 1, optim: str = "adamw", lr: float = LR, schedule: str = "constant",
               replicas: int = WORLD) -> dict:
    import torch

    model = _model()
    initial = _numpy(model.state_dict())
    data = _tokens(*TRAIN)
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=ADAM_EPS, weight_decay=0.0)
    n = PER_DEVICE * gas * replicas
    losses, norms, lrs = [], [], []
    for s in range(steps):
        step_lr = lr * (1 - s / steps) if schedule == "linear" else lr
        for group in opt.param_groups:
            group["lr"] = step_lr
        x = data[s * n:(s + 1) * n]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)))
        losses.append(float(loss.detach()))
        lrs.append(step_lr)
        opt.step()
        opt.zero_grad()
    model.eval()
    ex = _tokens(*EVAL)
    with torch.no_grad():
        eval_loss = float(model(input_ids=ex, labels=ex).loss)
    return {"weights": _numpy(model.state_dict()), "initial": initial, "losses": losses, "norms": norms,
            "lrs": lrs, "eval_loss": eval_loss}


def _assert_weights_close(got: dict, want: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=rtol, atol=atol, err_msg=key)


def _assert_same_on_every_rank(results: list[dict]) -> None:
    for key, value in results[0]["weights"].items():
        for other in results[1:]:
            np.testing.assert_array_equal(other["weights"][key], value, err_msg=key)


def _assert_logs_match(result: dict, ref: dict) -> None:
    """Logged losses and grad norms per step, and the eval loss, equal the reference's (4.57's Trainer
    logs the loss rounded to 4 decimals; 5.x logs it whole)."""
    from smp2ds.engine.integrations.transformers_compat import is_transformers_5

    logs = result["logs"]
    np.testing.assert_allclose([h["loss"] for h in logs], ref["losses"], rtol=1e-5,
                               atol=0 if is_transformers_5() else 5e-5)
    np.testing.assert_allclose([h["grad_norm"] for h in logs], ref["norms"], rtol=1e-4)
    np.testing.assert_allclose(result["eval_loss"], ref["eval_loss"], rtol=1e-5)


# ---- tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("gas", "user_optimizer"), [(1, False), (2, False), (1, True)],
                         ids=["gas1", "gas2", "gas1-optimizer-given"])
def test_trainer_trains_like_plain_pytorch(tmp_path: Any, gas: int, user_optimizer: bool) -> None:
    """Trainer(...).train() with microbatches 2 and gradient accumulation 1 or 2 (its own AdamW,
    or one given as optimizers=) takes the same AdamW steps (clipping included: the first step's
    norm is above 1) as plain PyTorch; the logged loss and grad norm are the reference's;
    evaluate() gives the reference eval loss."""
    steps = 3
    results = run_ranks(_train_worker, WORLD, {"out": str(tmp_path / "out"), "gas": gas, "steps": steps,
                                               "eval": True, "user_optimizer": user_optimizer},
                        env=_env(), timeout_s=TIMEOUT_S)
    ref = _reference(steps, gas)
    assert ref["norms"][0] > MAX_GRAD_NORM  # clipping is exercised
    for rank, r in enumerate(results):
        assert r["smp_mode"] and r["wrapped"] and r["distributed_optimizer"]
        assert (r["world_size"], r["process_index"], r["device"]) == (WORLD, rank, "cpu")
        assert r["adam_steps"] == [steps]
    _assert_same_on_every_rank(results)
    _assert_weights_close(results[0]["weights"], ref["weights"])
    _assert_logs_match(results[0], ref)


def test_pipeline_parallel_trainer_matches_plain_pytorch(tmp_path: Any) -> None:
    """partitions 2 on 2 ranks: one pipeline, data-parallel size 1, so both stages must train on
    the same batches (the repaired Trainer shards by smp.dp_rank, not by process). Weights (gathered over
    the stages), loss, grad norm (the tied embedding counted once) and eval loss match a
    single-replica reference."""
    steps = 3
    results = run_ranks(_train_worker, WORLD, {"out": str(tmp_path / "out"), "steps": steps, "eval": True},
                        env=_env(partitions=2), timeout_s=TIMEOUT_S)
    ref = _reference(steps, replicas=1)
    assert ref["norms"][0] > MAX_GRAD_NORM
    for r in results:
        assert (r["world_size"], r["process_index"]) == (1, 0) and r["wrapped"] and r["distributed_optimizer"]
    _assert_same_on_every_rank(results)
    _assert_weights_close(results[0]["weights"], ref["weights"])
    _assert_logs_match(results[0], ref)


@pytest.mark.parametrize(("smp_params", "replicas", "optimizer_files"), [
    ({}, WORLD, ["optimizer.pt_0_0.pt"]),
    ({"shard_optimizer_state": True}, WORLD, ["optimizer.pt_0_0_0.pt", "optimizer.pt_0_0_1.pt"]),
    ({"partitions": 2}, 1, ["optimizer.pt_0_0.pt", "optimizer.pt_1_0.pt"]),
], ids=["ddp", "shard_optimizer_state", "pipeline"])
def test_checkpoint_save_model_and_resume(tmp_path: Any, smp_params: dict, replicas: int,
                                          optimizer_files: list[str]) -> None:
    """A 4-step run saving a checkpoint every 2 steps matches the reference and writes SMP's
    per-rank optimizer files; Trainer.save_model writes a model from_pretrained loads; resuming
    from checkpoint-2 (model from the safetensors file, optimizer from the SMP files via the
    post-step hook) ends on exactly the same weights."""
    from transformers import GPT2LMHeadModel

    steps, out = 4, tmp_path / "run"
    full = run_ranks(_train_worker, WORLD, {"out": str(out), "steps": steps, "save_steps": 2,
                                            "final": str(tmp_path / "final")},
                     env=_env(**smp_params), timeout_s=TIMEOUT_S)
    _assert_same_on_every_rank(full)
    _assert_weights_close(full[0]["weights"], _reference(steps, replicas=replicas)["weights"])
    names = sorted(os.listdir(out / "checkpoint-2"))
    assert [n for n in names if n.startswith("optimizer")] == optimizer_files
    assert "model.safetensors" in names and "scheduler.pt" in names

    saved = GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    _assert_weights_close(_numpy(saved.state_dict()), full[0]["weights"], rtol=0, atol=0)

    resumed = run_ranks(_train_worker, WORLD, {"out": str(tmp_path / "resumed"), "steps": steps,
                                               "resume": str(out / "checkpoint-2")},
                        env=_env(**smp_params), timeout_s=TIMEOUT_S)
    for r in resumed:
        assert r["adam_steps"] == [steps]  # 2 restored + 2 new; a fresh optimizer would count 2
    _assert_weights_close(resumed[0]["weights"], full[0]["weights"], rtol=0, atol=0)


def test_fp16_path_clips_master_grads_and_schedules_the_inner_optimizer(tmp_path: Any) -> None:
    """"fp16": true in SM_HP_MP_PARAMETERS turns the Trainer's fp16 on, so it clips through
    optimizer.clip_master_grads (whose norm it logs) and builds the LR schedule on
    optimizer.optimizer. SGD keeps the update linear in the gradient, so the fp16 run must follow
    the fp32 reference within fp16 rounding (0.3% measured; bound 1%), linear schedule included."""
    steps, lr = 3, 0.5
    results = run_ranks(_train_worker, WORLD, {"out": str(tmp_path / "out"), "steps": steps, "optim": "sgd",
                                               "lr": lr, "schedule": "linear"},
                        env=_env(fp16=True), timeout_s=TIMEOUT_S)
    ref = _reference(steps, optim="sgd", lr=lr, schedule="linear")
    r = results[0]
    assert r["fp16"] and r["param_dtype"] == "torch.float16"
    _assert_same_on_every_rank(results)
    from smp2ds.engine.integrations.transformers_compat import trainer_logs_step_learning_rate

    # releases before about 4.51 log the rate after the scheduler stepped: the next step's (training is the same)
    want_lrs = ref["lrs"] if trainer_logs_step_learning_rate() else [*ref["lrs"][1:], 0.0]
    np.testing.assert_allclose([h["learning_rate"] for h in r["logs"]], want_lrs, rtol=1e-6)
    np.testing.assert_allclose([h["grad_norm"] for h in r["logs"]], ref["norms"], rtol=1e-3)
    moved = sum(float(((ref["weights"][k] - ref["initial"][k]) ** 2).sum()) for k in ref["weights"])
    error = sum(float(((r["weights"][k] - ref["weights"][k]) ** 2).sum()) for k in ref["weights"])
    assert (error / moved) ** 0.5 < 1e-2


def test_trainer_pt_utils_smp_helpers_on_the_engine() -> None:
    """transformers' smp_forward_backward / smp_forward_only / smp_gather / smp_nested_concat,
    called directly on smp2ds objects, give the plain model's losses, gradients and logits."""
    import torch

    results = run_ranks(_pt_utils_worker, WORLD, env=_env(), timeout_s=TIMEOUT_S)
    model = _model()
    data = _tokens(WORLD * PER_DEVICE, 3)
    mb = PER_DEVICE // MICROBATCHES
    for rank, r in enumerate(results):
        x = data[rank * PER_DEVICE:(rank + 1) * PER_DEVICE]
        with torch.no_grad():
            want = [float(model(input_ids=x[i:i + mb], labels=x[i:i + mb]).loss) / 2 for i in range(0, PER_DEVICE, mb)]
            logits = model(input_ids=x).logits.numpy()
        np.testing.assert_allclose(r["mb_losses"], want, rtol=1e-5)
        np.testing.assert_allclose(r["reduce_mean"], np.mean(want), rtol=1e-5)
        np.testing.assert_allclose(r["logits"], logits, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(r["gathered_scalar"], np.arange(WORLD, dtype=np.float32))
        np.testing.assert_array_equal(r["gathered_matrix"], np.repeat(np.arange(WORLD, dtype=np.float32), 2)[:, None]
                                      * np.ones((1, 3), dtype=np.float32))
    # Gradients are reduced over the data-parallel group: the mean loss of all 8 samples / 2.
    (model(input_ids=data, labels=data).loss / 2).backward()
    want_grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    for r in results:
        _assert_weights_close(r["grads"], want_grads, rtol=1e-4, atol=1e-7)


_IMPORT_ORDER_PROBE = """
import json, sys
exec(sys.argv[1])  # the script's first transformers import
from transformers import Trainer, TrainingArguments
args = TrainingArguments(output_dir=sys.argv[2], use_cpu=True)
print(json.dumps({"device": str(args.device), "world_size": args.world_size,
                  "arguments_repaired": TrainingArguments.__dict__.get("_smp2ds_smp_repairs", False),
                  "trainer_repaired": Trainer.__dict__.get("_smp2ds_smp_repairs", False)}))
"""


@pytest.mark.parametrize("first_import", ["from transformers import TrainingArguments",
                                          "from transformers import Trainer",
                                          "from transformers import GPT2LMHeadModel"],
                         ids=["training_args-imports-smp", "trainer-imports-smp", "modeling-imports-smp"])
def test_repairs_reach_transformers_whichever_module_imports_smp_first(tmp_path: Any, first_import: str) -> None:
    """Whichever transformers module imports smdistributed first (it is then half-executed, its
    classes not yet defined), TrainingArguments(use_cpu=True) gets the CPU device on the SMP path
    and Trainer carries the repairs. Stock transformers (4.57 and 5.x) fails here with UnboundLocalError."""
    import subprocess
    import sys

    from tests._dist import BASE_ENV

    env = dict(os.environ, **BASE_ENV, **_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               SMP2DS_INIT_METHOD=f"file://{tmp_path}/rendezvous",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ORDER_PROBE, first_import, str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "device": "cpu", "world_size": 1, "arguments_repaired": True, "trainer_repaired": True}


def test_clipping_under_smp_goes_through_clip_master_grads_and_refuses_other_norms() -> None:
    """The Trainer's accelerator clips through the optimizer's clip_master_grads under SMP, which
    clips the L2 norm only: another norm_type is refused by name rather than silently changed."""
    from types import SimpleNamespace

    from smp2ds.engine.api.hf_trainer_repairs import _clip_through_optimizer

    calls = []
    trainer = SimpleNamespace(optimizer=SimpleNamespace(clip_master_grads=lambda max_norm: calls.append(max_norm) or 3.0))
    assert _clip_through_optimizer(trainer, None, [], 1.5) == 3.0 and calls == [1.5]
    with pytest.raises(ValueError, match=r"clips the L2 norm; norm_type=1 is not supported \(allowed: 2\)"):
        _clip_through_optimizer(trainer, None, [], 1.0, norm_type=1)
