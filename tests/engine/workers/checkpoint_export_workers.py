"""Checkpoints to export, rank bodies that load the exports natively, and the single-process reference.

``smp_checkpoints`` trains the tiny GPT-2 two AdamW steps at tp 2 x pp 2, tp 2 x sdp 2 and ZeRO-1
over rdp 2 with the engine itself (``checkpoint_tools_workers.train_and_save``: real
``smp.save_checkpoint`` folders) once per test session. The exports are then loaded by code that
knows nothing of smp2ds, at another world size, and train steps 2 and 3; ``reference`` is one
uninterrupted process training steps 0..3 on the same 4 rows per step.

The loss is the mean token cross entropy over the step's global batch however its rows are split:
each rank sums its tokens' losses and divides by the global token count times ``1 / world``
(FSDP2 and DeepSpeed average gradients over ranks), so uneven splits (4 rows over 3 ranks) train
exactly like the single process.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from tests.engine.workers import checkpoint_tools_workers as cw
from tests.engine.workers import tp_sdp_workers as sdpw
from tests.engine.workers import tp_workers as tw
from tests.engine.workers import transformer_workers as trw
from tests.engine.workers.train_workers import plain

ROWS, SEED, SAVED_STEPS = 4, 40, 2
VOCAB = min(tw.VOCAB, trw.VOCAB)
LAYOUTS = {  # name: (world size, SMP config, gradient clipping of the saved run)
    "pp2-tp2": (4, {"ddp": True, "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "microbatches": 2},
                None),
    "tp2-sdp2": (4, sdpw.CONFIG, sdpw.CLIP),
    "zero1-rdp2": (2, {"ddp": True, "shard_optimizer_state": True}, None),
}


def smp_checkpoints(base: str) -> dict[str, str]:
    """``{layout: save_checkpoint folder of the GPT-2}``, trained once per session under ``base``."""
    from tests._dist import run_ranks

    out = {}
    for layout, (world, config, _) in LAYOUTS.items():
        root = os.path.join(base, layout)
        done = os.path.join(root, "done")
        if not os.path.isfile(done):
            run_ranks(cw.train_and_save, world, config, [{"name": "gpt2", "model": "gpt2", "seed": SEED}], root)
            open(done, "w").close()
        out[layout] = os.path.join(root, "gpt2")
    return out


def batch(step: int) -> torch.Tensor:
    return tw.global_ids(step, ROWS) % VOCAB


def loss_part(model: torch.nn.Module, ids: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's loss to backpropagate, its share of the global mean loss) for rows ``ids``."""
    logits = model(input_ids=ids, use_cache=False).logits
    total = ROWS * (ids.shape[1] - 1)
    summed = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1),
                             reduction="sum")
    return summed * world / total, summed.detach() / total


def reference(clip: float | None, steps: int = 4) -> dict[str, Any]:
    """One process, steps 0..``steps - 1`` (clipped like the saved run for its steps): losses and weights."""
    net = tw.hf_model("gpt2", SEED)
    opt = tw.make_optimizer("adamw", net.parameters())
    losses = []
    for step in range(steps):
        loss, _ = loss_part(net, batch(step), 1)
        loss.backward()
        if clip is not None and step < SAVED_STEPS:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def _init() -> tuple[int, int]:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["SMP2DS_INIT_METHOD"], rank=rank, world_size=world)
    return rank, world


def _train(model: torch.nn.Module, step_fn: Any, rank: int, world: int, steps: int,
           first: int = SAVED_STEPS) -> list[float]:
    """Steps ``first ..``: this rank's rows of each global batch; returns the global losses."""
    import torch.distributed as dist

    losses = []
    for step in range(first, first + steps):
        rows = torch.tensor_split(batch(step), world)[rank]
        loss, share = loss_part(model, rows, world)
        step_fn(loss)
        dist.all_reduce(share)
        losses.append(float(share))
    return losses


def _plain_step(opt: torch.optim.Optimizer) -> Any:
    """A plain PyTorch step: backward, the optimizer's step, gradients cleared."""
    def step(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def fsdp2_resume(path: str, steps: int = 2) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` per block and at the root) over this world: a fresh model with other
    weights loads the DCP export with ``dcp.load`` + ``set_state_dict`` and trains on."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    rank, world = _init()
    model = tw.hf_model("gpt2", SEED + 1000)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = tw.make_optimizer("adamw", model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    steps_after_load = [float(s["step"]) for s in opt.state.values()]

    losses = _train(model, _plain_step(opt), rank, world, steps)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"losses": losses, "steps_after_load": sorted(set(steps_after_load)),
           "state_dict": {k: v.clone() for k, v in full.items()} if rank == 0 else None}
    dist.barrier()
    dist.destroy_process_group()
    return plain(out)


def fsdp2_on_accelerates_mesh(steps: int) -> dict[str, Any]:
    """What ``accelerator.prepare`` does with an FSDP2 config, done by hand because accelerate 1.15 refuses FSDP on
    CPU ranks: the device mesh of accelerate's own ``ParallelismConfig`` (read from the ``PARALLELISM_CONFIG_*``
    environment its launcher gives the ranks, set by the caller), ``fully_shard`` on the mesh's FSDP dimensions per
    transformer block and at the root, resharding after forward. The reference's GPT-2 trains steps 0..``steps - 1``
    on this rank's rows; returns the global losses, the full weights (rank 0) and this rank's shard and replica
    groups."""
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    rank, world = _init()
    config = ParallelismConfig()
    mesh = config.build_device_mesh("cpu")
    fsdp_mesh = mesh[tuple(config.fsdp_dim_names)]
    model = tw.hf_model("gpt2", SEED)
    for block in model.transformer.h:
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=True)
    opt = tw.make_optimizer("adamw", model.parameters())

    losses = _train(model, _plain_step(opt), rank, world, steps, first=0)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {"losses": losses, "state_dict": {k: v.clone() for k, v in full.items()} if rank == 0 else None,
           "groups": {dim: sorted(dist.get_process_group_ranks(mesh[dim].get_group()))
                      for dim in ("dp_replicate", "dp_shard")},
           "shard_rows": int(next(model.parameters()).to_local().shape[0])}
    dist.barrier()
    dist.destroy_process_group()
    return plain(out)


def deepspeed_resume(path: str, stage: int, steps: int = 2, config: dict | None = None) -> dict[str, Any]:
    """A plain DeepSpeed script at ZeRO ``stage`` over this world (``load_universal``): a fresh model
    with other weights loads the universal export with ``engine.load_checkpoint`` and trains on. ``config``: the
    script's DeepSpeed config instead of the one built here (``load_universal`` is added, as a script would)."""
    import deepspeed
    import torch.distributed as dist

    rank, world = _init()
    model = tw.hf_model("gpt2", SEED + 1000)
    config = {**config, "checkpoint": {"load_universal": True}} if config is not None else {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
        "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
        "checkpoint": {"load_universal": True}}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=tw.make_optimizer("adamw", model.parameters()),
                                             config=config)
    load_path, _ = engine.load_checkpoint(path, load_module_strict=True)

    def step_fn(loss: torch.Tensor) -> None:
        engine.backward(loss)
        engine.step()

    losses = _train(engine, step_fn, rank, world, steps)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        full = {k: v.detach().clone() for k, v in engine.module.state_dict().items()} if rank == 0 else None
    out = {"losses": losses, "loaded": load_path, "global_steps": engine.global_steps, "state_dict": full}
    dist.barrier()
    return plain(out)
