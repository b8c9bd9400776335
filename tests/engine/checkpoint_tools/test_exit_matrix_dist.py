"""The checkpoint exits beyond GPT-2: GPT-NeoX and LLaMA (and GPT-2 through a pipeline) into FSDP2 and DeepSpeed.

Three SMP jobs train 2 AdamW steps (two groups split by weight decay, as SMP's example scripts) and save a partial
checkpoint, once per module:

* ``neox`` (2 ranks): SMP's GPT-NeoX script at ``tensor_parallel_degree`` 2: ``smp.model_creation`` with SMP's
  transformer settings makes ``smp.DistributedModel`` replace the Hugging Face ``GPTNeoXForCausalLM`` blocks by the
  distributed transformer (``transformer.seq_layers.<i>.attention.query`` ...), starting from the Hugging Face
  weights. The exports translate names, weights and both Adam moments back to Hugging Face's, the fused
  ``query_key_value`` (per head: q, k, v of head 0, then head 1 ...) rebuilt from SMP's q / k / v;
* ``llama`` (2 ranks): a Hugging Face ``LlamaForCausalLM`` (no distributed transformer) at
  ``sharded_data_parallel_degree`` 2, as SMP's GPT-2 example runs sdp: ``sdp_gradient_clipping`` 1.0 (it clips
  here), ``param_shapes`` in the user content, SMP's sharded-data-parallel folder layout (``--tag step2``);
* ``gpt2`` (4 ranks): SMP's GPT-2 script, distributed transformer at tp 2 x pp 2 (layers on two stages, the tied
  embedding on both).

Each checkpoint is exported with the CLI (Hugging Face names, the default) and continued 2 more steps on 2 ranks by
code that knows nothing of smp2ds, a fresh Hugging Face model with other weights:

* ``--to dcp``: plain FSDP2 (``fully_shard`` per block and at the root, gloo), ``get_state_dict`` / ``dcp.load`` /
  ``set_state_dict``: docs/leaving-smp.md's snippet (clipping where the job clipped);
* ``--to deepspeed-universal``: ``deepspeed.initialize`` with a ``smp2ds convert --to deepspeed --native`` config
  plus ``load_universal``, then ``engine.load_checkpoint``: ZeRO-1 (the data-parallel form of the jobs), AutoTP 2 with
  ZeRO-1 (the NeoX job's own tp layout), and the LLaMA job's own config, ZeRO-3 with clipping.

Proof, for every route: the losses of the 2 steps after the load (the global mean token cross entropy of the step's 4
rows) and the final weights equal one uninterrupted single process training the Hugging Face model all 4 steps on
the same rows, groups and clipping; Adam's step and each group's weight decay are checked after the load or the
steps. Tolerances: losses 1e-5, weights ``ADAMW_ATOL`` 3e-5 (rtol 1e-4), those of the GPT-2 export tests (AdamW's
division by the root of tiny second moments turns float sum order into ~1e-5 of an lr-sized update). A q / k / v
fused without the per-head interleave, in the weights or only in the moments, moves the losses by 4e-3 / 1e-3. The
sdp job's own uninterrupted smp2ds run equals the same reference: the exits equal staying on smp2ds.

What DeepSpeed 0.19.8 itself gets wrong on these routes is shown, not hidden: the AutoTP config ``convert --native``
writes is refused by ``deepspeed.initialize`` (its ``train_batch_size``), and its ZeRO-3 universal loader breaks
Adam's step and the groups' settings with more than one parameter group (:func:`repair_zero3_universal_load`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from smp2ds.cli import main
from tests._dist import run_ranks
from tests.engine.workers import checkpoint_export_workers as xw
from tests.engine.workers import checkpoint_tools_workers as cw
from tests.engine.workers import sdp_layout_workers as sw
from tests.engine.workers import tp_workers as tw
from tests.engine.workers.train_workers import plain

pytestmark = pytest.mark.slow

SEED, SAVED, AFTER, WORLD, ROWS_PER_RANK = 40, 2, 2, 2, 2
"""The job's seed, the steps before the save, the steps each exit trains after it, ranks of every run, the rows
each of the job's ranks reads (4 a step in all: ``checkpoint_export_workers.batch``)."""
LOSS_ATOL = 1e-5
WHOLE = {"steps": [float(SAVED + AFTER)], "weight_decay": [0.01, 0.0]}
"""The torch AdamW's state after the exit's 2 steps: Adam's step 4 everywhere, each group's own weight decay."""
NEOX_SMP = {"ddp": True, "tensor_parallel_degree": 2}
NEOX_FLAGS = ["--model-type", "gpt_neox", "--num-attention-heads", "4"]
"""cw's jobs save no model_config in their user content: the export is told the family (as SMP users do)."""
PIPELINE_SMP = {"ddp": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2}
GPT2_FLAGS = ["--model-type", "gpt2", "--num-attention-heads", "4"]


@dataclass(frozen=True)
class Family:
    """What the exit scripts need to know about a model: how to build it, shard it, group and clip it."""

    build: Callable[[int], torch.nn.Module]
    blocks: Callable[[torch.nn.Module], Any]
    groups: Callable[[torch.nn.Module], list[dict]]
    clip: float | None
    """The job's gradient clipping (``sdp_gradient_clipping``); the exit scripts clip the same way."""


FAMILIES = {
    "neox": Family(build=lambda seed: cw.hf_of("neox_replaced", seed), blocks=lambda m: m.gpt_neox.layers,
                   groups=lambda m: cw.decay_groups(m.named_parameters()), clip=None),
    "llama": Family(build=lambda seed: tw.hf_model("llama", seed), blocks=lambda m: m.model.layers,
                    groups=sw.param_groups, clip=sw.CONFIG["sdp_gradient_clipping"]),
    "gpt2": Family(build=lambda seed: cw.hf_of("gpt2_replaced", seed), blocks=lambda m: m.transformer.h,
                   groups=lambda m: cw.decay_groups(m.named_parameters()), clip=None),
}


# ---------------------------------------------------------------------------------------------
# the jobs (once per module) and the reference
@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``{"neox": checkpoint folder, "llama": checkpoint folder, "llama_run": the sdp job's own steps 2..3}``."""
    root = tmp_path_factory.mktemp("exit-matrix")
    run_ranks(cw.train_and_save, WORLD, NEOX_SMP, [{"name": "neox", "model": "neox_replaced", "seed": SEED,
                                                     "groups": True}], str(root))
    llama = root / "llama"
    # sw trains 4 steps uninterrupted and saves SMP's sdp layout after step 2 as tag "step2"
    llama_run = run_ranks(sw.train_and_save, WORLD, "llama", str(llama), SEED)[0]
    return {"neox": str(root / "neox"), "llama": str(llama), "llama_run": llama_run}


@pytest.fixture(scope="module")
def pipeline_job(tmp_path_factory: pytest.TempPathFactory) -> str:
    """SMP's GPT-2 script (distributed transformer, two weight-decay groups) at tp 2 x pp 2 on 4 ranks: its folder."""
    root = tmp_path_factory.mktemp("exit-matrix-pipeline")
    run_ranks(cw.train_and_save, 2 * WORLD, PIPELINE_SMP, [{"name": "gpt2", "model": "gpt2_replaced", "seed": SEED,
                                                             "groups": True}], str(root))
    return str(root / "gpt2")


def reference(family: str, steps: int = SAVED + AFTER) -> dict[str, Any]:
    """One process, the Hugging Face model, the job's groups and clipping, steps 0..``steps - 1`` on the rows the
    job's ranks read together: the global losses, rank 0's (its own rows), gradient norms before clipping, and
    the final weights."""
    fam = FAMILIES[family]
    net = fam.build(SEED)
    opt = tw.make_optimizer("adamw", fam.groups(net))
    losses, norms, rank0 = [], [], []
    for step in range(steps):
        with torch.no_grad():  # SMP's reduce_mean() averages a rank's micro-batches: rank 0 reports its own rows
            rank0.append(float(net(input_ids=xw.batch(step)[:ROWS_PER_RANK], labels=xw.batch(step)[:ROWS_PER_RANK],
                                   use_cache=False).loss))
        loss, _ = xw.loss_part(net, xw.batch(step), 1)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), fam.clip or float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"losses": losses, "norms": norms, "rank0_losses": rank0, "weights": weights}


def _check_continuation(got: list[dict], want: dict[str, Any], what: str) -> None:
    """Every rank's losses after the load, and rank 0's full weights, equal the uninterrupted reference."""
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    for rank, result in enumerate(got):
        tpd._close(result["losses"], want["losses"][SAVED:], f"{what}: rank {rank} losses after the load", LOSS_ATOL)
    weights = {k: torch.from_numpy(v) for k, v in got[0]["state_dict"].items()}
    assert sorted(weights) == sorted(want["weights"]), what
    for key, value in want["weights"].items():
        tpd._close(weights[key], value, f"{what}: {key}", tpd.ADAMW_ATOL)


# ---------------------------------------------------------------------------------------------
# rank bodies: plain PyTorch / DeepSpeed scripts (module level: run_ranks pickles them by name)
def _train(model: torch.nn.Module, step_fn: Callable[[torch.Tensor], None], dp_rank: int, dp: int) -> list[float]:
    """Steps ``SAVED ..``: this data-parallel rank's rows of each global batch; the global losses.

    ``dp`` ranks split the rows (a tensor-parallel group reads the same ones): each backpropagates its tokens' summed
    loss over the global token count times ``dp`` (FSDP2 and DeepSpeed average gradients over data-parallel ranks),
    so the update is the one of the mean over all 4 rows."""
    import torch.distributed as dist

    losses = []
    for step in range(SAVED, SAVED + AFTER):
        rows = torch.tensor_split(xw.batch(step), dp)[dp_rank]
        loss, share = xw.loss_part(model, rows, dp)
        step_fn(loss)
        if dp > 1:
            dist.all_reduce(share)
        losses.append(float(share))
    return losses


def fsdp2_resume(family: str, path: str) -> dict[str, Any]:
    """docs/leaving-smp.md's FSDP2 snippet: ``fully_shard`` each block and the root of a fresh Hugging Face model
    (other weights), AdamW over the job's groups, ``dcp.load`` + ``set_state_dict``, then train (clipping as the job
    did). Returns the losses, the Adam step and group settings after the load, and (rank 0) the full weights."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    rank, world = xw._init()
    fam = FAMILIES[family]
    model = fam.build(SEED + 1000)
    for block in fam.blocks(model):
        fully_shard(block)
    fully_shard(model)
    opt = tw.make_optimizer("adamw", fam.groups(model))
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = {"steps": sorted({float(s["step"]) for s in opt.state.values()}),
              "weight_decay": [g["weight_decay"] for g in opt.param_groups]}

    def step_fn(loss: torch.Tensor) -> None:
        loss.backward()
        if fam.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), fam.clip)
        opt.step()
        opt.zero_grad()

    losses = _train(model, step_fn, rank, world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"losses": losses, "loaded": loaded,
           "state_dict": {k: v.clone() for k, v in full.items()} if rank == 0 else None}
    dist.barrier()
    dist.destroy_process_group()
    return plain(out)


def repair_zero3_universal_load(engine: Any, path: str) -> None:
    """After ``engine.load_checkpoint`` of a universal checkpoint at ZeRO-3 (DeepSpeed 0.19.8): give every parameter
    group its own settings and every optimizer state its own step back.

    DeepSpeed's ZeRO-3 loader (``stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``) puts one and the same
    ``step`` tensor (``optimizer_state.pt``'s) into the state of every sub-group, and torch's AdamW advances it in
    place once per sub-group and engine step (two groups: 2 -> 4 -> 6, not 3, 4: wrong bias corrections); and it
    copies group 0's hyperparameters onto every group (the no-decay group decays). DeepSpeed's own
    ``ds_to_universal`` output is loaded by the same code."""
    with open(os.path.join(path, "latest_universal")) as handle:
        tag = handle.read().strip()
    saved = torch.load(os.path.join(path, tag, "zero", "optimizer_state.pt"), weights_only=False)["param_groups"]
    inner = engine.optimizer.optimizer
    assert len(saved) == len(inner.param_groups)
    for group, settings in zip(inner.param_groups, saved):
        group.update({k: v for k, v in settings.items() if k != "params"})
    for state in inner.state.values():
        state["step"] = state["step"].clone()


def deepspeed_resume(family: str, path: str, config: dict, repair: bool = False) -> dict[str, Any]:
    """docs/leaving-smp.md's DeepSpeed snippet: ``deepspeed.initialize`` of a fresh Hugging Face model (other weights)
    with a torch AdamW over the job's groups and ``config`` plus ``load_universal``, ``engine.load_checkpoint``, then
    train. AutoTP (``tensor_parallel.autotp_size``) ranks of one group read the same rows. ``repair``:
    :func:`repair_zero3_universal_load` after the load."""
    import deepspeed
    import torch.distributed as dist

    rank, world = xw._init()
    fam = FAMILIES[family]
    model = fam.build(SEED + 1000)
    config = {**config, "checkpoint": {"load_universal": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=tw.make_optimizer("adamw", fam.groups(model)),
                                           config=config)
    load_path, _ = engine.load_checkpoint(path, load_module_strict=True)
    if repair:
        repair_zero3_universal_load(engine, path)
    tp = config.get("tensor_parallel", {}).get("autotp_size", 1)

    def step_fn(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    losses = _train(engine, step_fn, rank // tp, world // tp)
    if engine.zero_optimization_stage() == 3 or tp > 1:  # parameters are cut: DeepSpeed's gather (all ranks call it)
        full = engine._consolidated_16bit_state_dict()
    else:
        full = engine.module.state_dict()
    inner = engine.optimizer.optimizer  # the torch AdamW the ZeRO optimizer steps
    after = {"steps": sorted({float(s["step"]) for s in inner.state.values()}),
             "weight_decay": [g["weight_decay"] for g in inner.param_groups]}
    out = {"losses": losses, "loaded": load_path, "global_steps": engine.global_steps, "after": after,
           "state_dict": {k: v.detach().clone() for k, v in full.items()} if rank == 0 else None}
    dist.barrier()
    return plain(out)


# ---------------------------------------------------------------------------------------------
# helpers of the tests
def _export(path: str, to: str, out: str, *flags: str) -> None:
    assert main(["checkpoint", "export", path, "--to", to, out, "--quiet", *flags]) == 0


def _native(tmp_path: Any, smp: dict, *flags: str) -> dict:
    """``smp2ds convert SMP --to deepspeed --native`` at 2 ranks, SMP's per-rank batch 2: the exit script's config."""
    source, target = tmp_path / "smp.json", tmp_path / "ds.json"
    source.write_text(json.dumps(smp), encoding="utf-8")
    assert main(["convert", str(source), "--to", "deepspeed", "--native", "--world-size", str(WORLD),
                 "--batch-size", "2", "-o", str(target), *flags]) == 0
    return json.loads(target.read_text())


# ---------------------------------------------------------------------------------------------
# the tests
def test_neox_distributed_transformer_dcp_export_continues_under_fsdp2(jobs, tmp_path):
    """GPT-NeoX, distributed transformer at tp 2 -> ``--to dcp`` (Hugging Face names) -> FSDP2 over 2 ranks: the
    losses of steps 2 and 3 and the final weights equal the uninterrupted Hugging Face run; Adam's step (2) and both
    groups' weight decay arrive."""
    out = str(tmp_path / "dcp")
    _export(jobs["neox"], "dcp", out, *NEOX_FLAGS)
    got = run_ranks(fsdp2_resume, WORLD, "neox", out)
    assert all(r["loaded"] == {"steps": [float(SAVED)], "weight_decay": [0.01, 0.0]} for r in got)
    _check_continuation(got, reference("neox"), "neox dcp -> fsdp2")


def test_neox_distributed_transformer_universal_export_continues_under_deepspeed_zero1(jobs, tmp_path):
    """GPT-NeoX, distributed transformer at tp 2 -> ``--to deepspeed-universal`` -> DeepSpeed ZeRO-1 over 2
    data-parallel ranks, the config ``convert --native`` writes for the job's data-parallel form
    (``shard_optimizer_state`` without tensor parallelism): equal to the uninterrupted Hugging Face run."""
    config = _native(tmp_path, {"ddp": True, "shard_optimizer_state": True})
    assert config["zero_optimization"] == {"stage": 1} and "tensor_parallel" not in config
    out = str(tmp_path / "universal")
    _export(jobs["neox"], "deepspeed-universal", out, *NEOX_FLAGS)
    got = run_ranks(deepspeed_resume, WORLD, "neox", out, config)
    assert all(r["loaded"] is not None and r["global_steps"] == SAVED + AFTER and r["after"] == WHOLE for r in got)
    _check_continuation(got, reference("neox"), "neox universal -> zero1")


def test_neox_universal_export_continues_under_deepspeed_autotp(jobs, tmp_path):
    """The same export under the native config of the job's own layout, tp 2 with ``shard_optimizer_state`` (ZeRO-1:
    DeepSpeed's universal loader serves ZeRO stages 1-3 only; the job's own tp-only config is stage 0, which
    ``load_checkpoint`` cannot load a universal checkpoint into, and ``convert --native`` says so): the config as
    written (its ``train_batch_size`` counts all ranks, as DeepSpeed's check does with AutoTP from the config);
    DeepSpeed's AutoTP cuts the fused ``query_key_value`` and the head out of the full tensors with its own restore
    metadata, and the run equals the uninterrupted one."""
    config = _native(tmp_path, {**NEOX_SMP, "shard_optimizer_state": True}, "--model-type", "gpt_neox")
    assert config["tensor_parallel"] == {"autotp_size": 2} and config["zero_optimization"] == {"stage": 1}
    assert config["train_micro_batch_size_per_gpu"] == 2 * WORLD  # the tensor-parallel group feeds all 4 rows
    assert config["train_batch_size"] == 2 * WORLD * WORLD
    out = str(tmp_path / "universal")
    _export(jobs["neox"], "deepspeed-universal", out, *NEOX_FLAGS)
    got = run_ranks(deepspeed_resume, WORLD, "neox", out, config)
    assert all(r["loaded"] is not None and r["after"] == WHOLE for r in got)
    _check_continuation(got, reference("neox"), "neox universal -> autotp zero1")


def test_llama_sdp_dcp_export_continues_under_fsdp2(jobs, tmp_path):
    """LLaMA at sdp 2 (SMP's sdp folder layout, two groups, clipping at 1.0) -> ``--to dcp`` -> FSDP2 over 2 ranks
    clipping at 1.0 like the job (and the clipping clips): equal to the uninterrupted Hugging Face run."""
    out = str(tmp_path / "dcp")
    _export(jobs["llama"], "dcp", out, "--tag", "step2")
    got = run_ranks(fsdp2_resume, WORLD, "llama", out)
    assert all(r["loaded"] == {"steps": [float(SAVED)], "weight_decay": [0.01, 0.0]} for r in got)
    want = reference("llama")
    assert max(want["norms"][SAVED:]) > FAMILIES["llama"].clip  # the clipping clips: a script without it differs
    _check_continuation(got, want, "llama dcp -> fsdp2")


def test_llama_sdp_universal_export_continues_under_deepspeed_zero1(jobs, tmp_path):
    """LLaMA at sdp 2 -> ``--to deepspeed-universal`` -> DeepSpeed ZeRO-1 over 2 ranks (``convert --native`` of
    ``shard_optimizer_state``, with the job's clipping at 1.0 added: SMP clipped only under sdp, so that config has
    none): both groups, their settings and Adam's step arrive whole; equal to the uninterrupted run."""
    config = {**_native(tmp_path, {"ddp": True, "shard_optimizer_state": True}), "gradient_clipping": 1.0}
    assert config["zero_optimization"] == {"stage": 1}
    out = str(tmp_path / "universal")
    _export(jobs["llama"], "deepspeed-universal", out, "--tag", "step2")
    got = run_ranks(deepspeed_resume, WORLD, "llama", out, config)
    assert all(r["loaded"] is not None and r["global_steps"] == SAVED + AFTER and r["after"] == WHOLE for r in got)
    _check_continuation(got, reference("llama"), "llama universal -> zero1")


@pytest.mark.parametrize("repair", [True, False], ids=["repaired", "as-loaded"])
def test_llama_sdp_universal_export_continues_under_the_native_zero3_config(jobs, tmp_path, repair):
    """LLaMA at sdp 2 -> ``--to deepspeed-universal`` -> the job's ``convert --native`` config unchanged but
    ``load_universal`` (sdp 2 over 2 ranks: plain ZeRO-3, ``gradient_clipping`` 1.0), with the two weight-decay groups
    SMP's scripts use: after :func:`repair_zero3_universal_load` Adam's step ends at 4 in every group, each group
    keeps its weight decay, and the run equals the uninterrupted one. ``as-loaded`` (no repair) xfails while
    DeepSpeed's loader shows the shared step or group 0's settings (and only then)."""
    config = _native(tmp_path, sw.CONFIG)
    assert config["zero_optimization"] == {"stage": 3} and config["gradient_clipping"] == 1.0
    out = str(tmp_path / "universal")
    _export(jobs["llama"], "deepspeed-universal", out, "--tag", "step2")
    got = run_ranks(deepspeed_resume, WORLD, "llama", out, config, repair)
    assert all(r["loaded"] is not None and r["global_steps"] == SAVED + AFTER for r in got)
    if not repair and got[0]["after"] != WHOLE:
        pytest.xfail(f"DeepSpeed 0.19.8's ZeRO-3 universal loader: after 2 steps {got[0]['after']}, not {WHOLE} "
                     "(one step tensor shared by the sub-groups, group 0's settings on every group)")
    assert all(r["after"] == WHOLE for r in got)
    _check_continuation(got, reference("llama"), "llama universal -> native zero3")


def test_the_sdp_jobs_own_run_is_the_reference(jobs):
    """The uninterrupted smp2ds sdp run (rank 0's losses of steps 2..3 after the save, final weights) equals the
    single-process reference the exits are held to: the exits equal staying on smp2ds."""
    from tests.engine.tensor_parallel import test_tensor_parallel_dist as tpd

    run, want = jobs["llama_run"], reference("llama")
    tpd._close(run["losses"], want["rank0_losses"][SAVED:], "llama sdp run: rank 0 losses", LOSS_ATOL)
    assert sorted(run["final"]) == sorted(want["weights"])
    for key, value in want["weights"].items():
        tpd._close(torch.from_numpy(run["final"][key]), value, f"llama sdp run: {key}", tpd.ADAMW_ATOL)


def test_gpt2_distributed_transformer_tp2_pp2_universal_export_continues_under_deepspeed_zero1(pipeline_job, tmp_path):
    """SMP's GPT-2 script at tp 2 x pp 2 (the distributed transformer's layers on two stages, the tied embedding on
    both) -> ``--to deepspeed-universal`` -> DeepSpeed ZeRO-1 over 2 ranks (``convert --native`` refuses pipelines:
    the data-parallel form's config): the tied head is the embedding's parameter; equal to the uninterrupted run."""
    config = _native(tmp_path, {"ddp": True, "shard_optimizer_state": True})
    out = str(tmp_path / "universal")
    _export(pipeline_job, "deepspeed-universal", out, *GPT2_FLAGS)
    assert sorted(os.listdir(os.path.join(out, "step2", "zero", "lm_head.weight"))) == ["fp32.pt"]  # weights only
    got = run_ranks(deepspeed_resume, WORLD, "gpt2", out, config)
    assert all(r["loaded"] is not None and r["global_steps"] == SAVED + AFTER and r["after"] == WHOLE for r in got)
    _check_continuation(got, reference("gpt2"), "gpt2 tp2 x pp2 universal -> zero1")


def test_gpt2_distributed_transformer_tp2_pp2_dcp_export_continues_under_fsdp2(pipeline_job, tmp_path):
    """The same checkpoint -> ``--to dcp`` -> FSDP2 over 2 ranks: equal to the uninterrupted run."""
    out = str(tmp_path / "dcp")
    _export(pipeline_job, "dcp", out, *GPT2_FLAGS)
    got = run_ranks(fsdp2_resume, WORLD, "gpt2", out)
    assert all(r["loaded"] == {"steps": [float(SAVED)], "weight_decay": [0.01, 0.0]} for r in got)
    _check_continuation(got, reference("gpt2"), "gpt2 tp2 x pp2 dcp -> fsdp2")
