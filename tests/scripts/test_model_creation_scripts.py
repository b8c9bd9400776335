"""SMP-style scripts that build their model through ``smp.model_creation`` run for real and match PyTorch.

``model_creation/gpt2_sdp.py`` is written like SMP's GPT-2 sharded-data-parallel example: a Hugging
Face GPT-2 built from its config inside ``smp.model_creation`` (transformers imports the model code
lazily there, under DeepSpeed's ``zero.Init``), weight-decay parameter groups, ``@smp.step`` with
``model.backward``, ``sdp_gradient_clipping`` that clips, and DeepSpeed ZeRO state read through the
``DistributedOptimizer``. It is launched with ``torchrun`` and compared with a single-process PyTorch
run of the same model, seed and tokens (union of the ranks' batches): per-rank losses, gradient
norms and final weights. The first loss must be about ln(vocab), which it is only when GPT-2's own
init (N(0, 0.02)) survived partitioned creation.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from tests.scripts.torchrun_launch import run_torchrun

HERE = Path(__file__).resolve().parent
GPT2_SCRIPT = HERE / "model_creation" / "gpt2_sdp.py"
ADAMW_WEIGHT_ATOL = 1e-4
"""AdamW turns rounding noise in near-zero gradients into steps of size lr (the key bias gets no
gradient at all): the single-process run itself moves by 4.4e-5 (3 steps, lr 0.01) when its batch is
summed in 4 pieces instead of 1. Losses and gradient norms are compared at rel 1e-5, and SGD
weights at atol 1e-6 (its floor is 1e-8)."""


def _script_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpt2_reference(*, world: int, steps: int, batch: int, optimizer: str, lr: float, clip: float,
                    weight_decay: float = 0.01, seed: int = 12345, pretrained: Path | None = None) -> dict:
    """The script's training in one process: the whole job's batch per step, torch clipping."""
    from transformers import AutoModelForCausalLM, set_seed

    script = _script_module(GPT2_SCRIPT)
    set_seed(seed)
    if pretrained is None:
        model = AutoModelForCausalLM.from_config(script.model_config())
    else:
        model = AutoModelForCausalLM.from_pretrained(pretrained)
    opt = script.make_optimizer(optimizer, script.get_param_groups_by_weight_decay(model, weight_decay), lr)
    data = script.tokens(steps, batch * world)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        with torch.no_grad():
            losses.append([model(input_ids=data[step, r * batch:(r + 1) * batch],
                                 labels=data[step, r * batch:(r + 1) * batch]).loss.item() for r in range(world)])
        model(input_ids=data[step], labels=data[step]).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
    return {"losses": losses, "norms": norms, "weights": model.state_dict()}


def _check_gpt2_run(reports: list[dict], ref: dict, *, world: int, clip: float, weight_atol: float) -> None:
    assert all(n > clip for n in ref["norms"]), f"clipping must bite at every step: norms {ref['norms']}"
    vocab_loss = reports[0]["ln_vocab"]
    for rank, rep in enumerate(reports):
        assert rep["born_partitioned"] and rep["partitioned_after_wrap"], rank
        assert rep["shard"] == [rank % 2, 2], rep["shard"]
        assert rep["param_partition_numel"] * 2 == rep["param_full_numel"], rep
        assert sum(rep["fp32_flat_numel"]) == rep["param_partition_numel"]  # ZeRO state through the wrapper
        assert len(rep["fp32_flat_numel"]) == 2  # the script's two weight-decay groups
        assert rep["clip_master_grads_returned_none"] == [True] * len(rep["losses"])
        assert rep["dtype_refusal"] is not None and "model_creation(dtype=torch.bfloat16)" in rep["dtype_refusal"]
        assert "training precision torch.float32" in rep["dtype_refusal"], rep["dtype_refusal"]
        assert abs(rep["losses"][0] - vocab_loss) < 0.05, f"first loss {rep['losses'][0]} is not ~ln V"
        want = [per_rank[rep["dp_rank"]] for per_rank in ref["losses"]]
        assert rep["losses"] == pytest.approx(want, rel=1e-5), (rank, rep["losses"], want)
        # DeepSpeed's norm (after the replica all-reduce), read through optimizer._global_grad_norm.
        assert rep["grad_norms"] == pytest.approx(ref["norms"], rel=1e-5), (rank, rep["grad_norms"])
        assert sorted(k.removeprefix("module.") for k in rep["weights"]) == sorted(ref["weights"])
        for key, values in rep["weights"].items():
            want_w = ref["weights"][key.removeprefix("module.")].flatten()
            got = torch.tensor(values)
            assert torch.allclose(got, want_w, rtol=1e-4, atol=weight_atol), (
                f"rank {rank} {key}: max diff {float((got - want_w).abs().max()):.3g}")


@pytest.mark.slow
def test_gpt2_sdp_script_with_delayed_init_and_adamw_matches_single_process():
    """sdp 2 on 2 ranks, delayed_parameter_initialization (zero_init follows it), AdamW, clipping at 0.3."""
    clip = 0.3
    args = ["--steps", "3", "--optimizer", "adamw", "--lr", "0.01", "--grad-clip", str(clip),
            "--delayed-param", "1", "--zero-init", "default"]
    reports = run_torchrun(GPT2_SCRIPT, 2, args, timeout_s=500)
    ref = _gpt2_reference(world=2, steps=3, batch=4, optimizer="adamw", lr=0.01, clip=clip)
    _check_gpt2_run(reports, ref, world=2, clip=clip, weight_atol=ADAMW_WEIGHT_ATOL)


@pytest.mark.slow
def test_gpt2_sdp_fine_tune_script_with_zero_init_sgd_and_two_replicas_matches_single_process(tmp_path):
    """SMP's fine-tuning branch: ``from_pretrained`` inside ``model_creation(zero_init=True)`` without
    delayed init (parameters partitioned at creation, checkpoint loaded into the partitions); sdp 2
    on 4 ranks (two MiCS replicas), plain SGD (no normalisation hiding gradient scale), clipping at 0.3."""
    from transformers import AutoModelForCausalLM

    script = _script_module(GPT2_SCRIPT)
    torch.manual_seed(99)  # not the script's seed: only loading gives the reference's weights
    AutoModelForCausalLM.from_config(script.model_config()).save_pretrained(tmp_path / "pretrained")
    clip = 0.3
    args = ["--steps", "3", "--optimizer", "sgd", "--lr", "0.5", "--grad-clip", str(clip), "--delayed-param", "0",
            "--zero-init", "true", "--train-batch-size", "2", "--microbatches", "2", "--fine-tune", "1",
            "--model-dir", str(tmp_path / "pretrained")]
    reports = run_torchrun(GPT2_SCRIPT, 4, args, timeout_s=500)
    ref = _gpt2_reference(world=4, steps=3, batch=2, optimizer="sgd", lr=0.5, clip=clip,
                          pretrained=tmp_path / "pretrained")
    _check_gpt2_run(reports, ref, world=4, clip=clip, weight_atol=1e-6)


# ---- model_creation's keywords, checked before anything is created -----------------------------

def test_model_creation_refuses_unknown_keywords_and_bad_values_naming_them():
    import smdistributed.modelparallel.torch as smp

    with pytest.raises(Exception, match=r"unknown keyword argument\(s\) \['zero_int'\]; accepted: .*zero_init"):
        with smp.model_creation(zero_int=True):
            pass
    with pytest.raises(Exception, match=r"zero_init=\.\.\.\) must be True, False or None, got 'yes'"):
        with smp.model_creation(zero_init="yes"):
            pass
    with pytest.raises(Exception, match=r"dtype=\.\.\.\) must be a floating-point torch.dtype .* got torch.int64"):
        with smp.model_creation(dtype=torch.int64):
            pass
    with pytest.raises(Exception, match=r"tensor_parallelism=\.\.\.\) must be a bool, got 'on'"):
        with smp.model_creation(tensor_parallelism="on"):
            pass


def test_model_creation_accepts_smp_example_keywords_and_restores_the_default_dtype():
    import smdistributed.modelparallel.torch as smp

    before = torch.get_default_dtype()
    with smp.model_creation(tensor_parallelism=False, zero_init=True, dtype=torch.bfloat16,
                            distribute_embedding=False, use_alibi=False, attention_in_fp32=False,
                            fp32_residual_addition=False, query_key_layer_scaling=True, fused_softmax=True,
                            fused_dropout=False, fused_bias_gelu=False, flash_attention=False):
        layer = torch.nn.Linear(2, 2)
    assert layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == before
    assert math.isfinite(float(layer.weight.detach().float().sum()))


# ---- DistributedOptimizer: add_param_group and the script's own optimizer methods -------------

UNFREEZE_SCRIPT = HERE / "model_creation" / "finetune_unfreeze.py"


def _unfreeze_reference(world: int, late_unfreeze: bool) -> tuple[list[float], dict]:
    script = _script_module(UNFREEZE_SCRIPT)
    model = script.make_model()
    layers = list(model)
    opt = torch.optim.SGD([{"params": layers[4].parameters(), "lr": script.LRS["head"]},
                           {"params": layers[2].parameters(), "lr": script.LRS["block2"]}])
    x, y = script.dataset(world)
    losses = []
    for step in range(script.STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        losses.append(loss.item())
        loss.backward()
        opt.step()
        if step == 0 and late_unfreeze:
            opt.add_param_group({"params": list(layers[0].parameters()), "lr": script.LRS["block1"]})
    return losses, model.state_dict()


def _check_unfreeze(reports: list[dict], ref_losses: list[float], ref_weights: dict) -> None:
    for rank, rep in enumerate(reports):
        assert rep["repeated_group"] == ("SMPInvalidArgumentError: add_param_group: 2 parameter(s) of the group "
                                         "are already in another parameter group"), rep["repeated_group"]
        # every rank's loss is its own half of the batch; their mean is the reference's loss
        assert sum(r["losses"][0] for r in reports) / len(reports) == pytest.approx(ref_losses[0], rel=1e-6)
        for key, values in rep["weights"].items():
            want = ref_weights[key.removeprefix("module.")].flatten()
            got = torch.tensor(values)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (
                f"rank {rank} {key}: max diff {float((got - want).abs().max()):.3g}")


@pytest.mark.slow
def test_unfreezing_with_add_param_group_under_plain_data_parallelism():
    """fp32 DDP: DeepSpeed steps the script's optimizer itself, so groups can be added at any time."""
    reports = run_torchrun(UNFREEZE_SCRIPT, 2, smp_parameters={"ddp": True, "microbatches": 2}, timeout_s=400)
    losses, weights = _unfreeze_reference(2, late_unfreeze=True)
    assert [r["late_unfreeze"] for r in reports] == ["added", "added"]
    assert reports[0]["group_lrs"] == [0.1, 0.05, 0.02]  # the script's own method, through the wrapper
    _check_unfreeze(reports, losses, weights)


@pytest.mark.slow
def test_unfreezing_with_add_param_group_under_sharded_data_parallelism():
    """ZeRO-3 (sdp 2): a group added before the first step rebuilds the engine around it; one added
    after a step is refused with the reason (DeepSpeed's flattened partitions hold the state)."""
    smp_parameters = {"ddp": True, "microbatches": 2, "sharded_data_parallel_degree": 2,
                      "sdp_gradient_clipping": 1e6, "sdp_param_persistence_threshold": 0}
    reports = run_torchrun(UNFREEZE_SCRIPT, 2, smp_parameters=smp_parameters, timeout_s=400)
    losses, weights = _unfreeze_reference(2, late_unfreeze=False)
    for rep in reports:
        assert rep["ds_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
        assert rep["late_unfreeze"].startswith("SMPUnsupportedError: add_param_group after the first "
                                               "optimizer.step() with mics (zero stage 3, fp32)"), rep["late_unfreeze"]
        assert "add every group before the first step" in rep["late_unfreeze"]
        assert rep["group_lrs"] == [0.1, 0.05]
    _check_unfreeze(reports, losses, weights)


def test_transformers_and_deepspeed_names_param_creation_relies_on_still_exist():
    """engine/mics/param_creation.py leans on these; on an upgrade this names what to re-check."""
    import inspect

    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from transformers import modeling_utils
    from transformers.integrations import deepspeed as hf_deepspeed

    params = list(inspect.signature(modeling_utils.PreTrainedModel._initialize_weights).parameters)
    assert params[:2] == ["self", "module"], "PreTrainedModel._initialize_weights(self, module, ...) changed"
    assert hasattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref") and hasattr(hf_deepspeed, "set_hf_deepspeed_config")
    assert "_hf_deepspeed_config_weak_ref" in inspect.getsource(hf_deepspeed.is_deepspeed_zero3_enabled)
    assert hasattr(modeling_utils, "set_zero3_state"), "transformers no longer skips nested zero.Init this way"
    assert hasattr(ZeroParamStatus, "NOT_AVAILABLE")


@pytest.mark.slow
def test_model_whose_builder_first_imports_transformers_inside_delayed_init_gets_eager_weights():
    """transformers (and torch._dynamo) imported for the first time under zero.Init: the build works,
    the partitioned GPT-2 holds exactly the weights of an eager build with the same seed, and
    reading them before the optimizer exists does not stop training."""
    script_path = HERE / "model_creation" / "local_import_build.py"
    reports = run_torchrun(script_path, 2, timeout_s=400)
    torch.manual_seed(0)
    eager = _script_module(script_path).build_model().state_dict()
    assert eager["transformer.wte.weight"].std() < 0.03  # GPT-2's N(0, 0.02), not nn.Embedding's N(0, 1)
    for rank, rep in enumerate(reports):
        assert not rep["transformers_imported_before"] and rep["partitioned"], rank
        assert sorted(k.removeprefix("module.") for k in rep["weights"]) == sorted(eager)
        for key, values in rep["weights"].items():
            assert torch.equal(torch.tensor(values), eager[key.removeprefix("module.")].flatten()), (rank, key)
    # state_dict() before DistributedOptimizer built an engine without optimizer; training still works:
    # one SGD step equals the single-process step on both ranks' tokens (its loss is the ranks' mean).
    script = _script_module(script_path)
    torch.manual_seed(0)
    model = script.build_model()
    ids = script.tokens().reshape(-1, 16)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # sdp_gradient_clipping's default
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    assert sum(r["loss"] for r in reports) / 2 == pytest.approx(loss.item(), rel=1e-6)
    for rank, rep in enumerate(reports):
        for key, values in rep["trained"].items():
            want = model.state_dict()[key.removeprefix("module.")].flatten()
            assert torch.allclose(torch.tensor(values), want, rtol=1e-5, atol=1e-7), (rank, key)
