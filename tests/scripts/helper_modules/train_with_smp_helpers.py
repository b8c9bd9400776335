"""An SMP-style script using the helper modules SMP's public examples import (run unchanged by the tests):

* ``from smdistributed.modelparallel.torch.optimizers import FusedLAMB`` (the BERT example), ``FusedAdam`` or
  ``FusedNovoGrad`` (the Mask R-CNN example), chosen by ``--optimizer``;
* ``from smdistributed.modelparallel.torch.state_mod import state`` (``state.cfg``, ``state.model``);
* ``from smdistributed.modelparallel.torch.utils import rmsg, get_distribution_axis`` (log lines, and the
  parameters tensor parallelism split);
* ``model.module.module``: the model behind SMP's data-parallel wrapper, the way SMP's tensor-parallel GPT-J and
  ViT examples reach it (to checkpoint its layers' activations), and the GPT example's loop that unwraps while
  ``isinstance(m, DistributedDataParallel)``.

A small MLP, its layers built inside ``smp.tensor_parallelism()`` and assigned to pipeline partitions with
``smp.partition``, trained for a few steps through ``@smp.step`` (each data-parallel rank its own rows). With
``--reference 1`` it runs as one plain process (no SMP) on the union of the ranks' rows, with each rank's loss. Writes ``rank<N>.json`` into ``$SMP2DS_SCRIPT_OUT``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
from torch import nn
from torch.nn.parallel.distributed import DistributedDataParallel

import smdistributed.modelparallel.torch as smp
from smdistributed.modelparallel.torch.optimizers import FusedAdam, FusedLAMB, FusedNovoGrad
from smdistributed.modelparallel.torch.state_mod import state
from smdistributed.modelparallel.torch.utils import get_distribution_axis, rmsg

OPTIMIZERS = {"lamb": FusedLAMB, "adam": FusedAdam, "novograd": FusedNovoGrad}
ROWS, STEPS = 4, 3


class Net(nn.Module):
    def __init__(self, partitioned: bool):
        super().__init__()
        first = smp.partition(0) if partitioned else contextlib.nullcontext()
        second = smp.partition(1) if partitioned else contextlib.nullcontext()
        with first:
            self.up = nn.Linear(8, 16)
        with second:
            self.down = nn.Linear(16, 4)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.down(torch.tanh(self.up(x))), y)


def batch(step, rows):
    g = torch.Generator().manual_seed(40 + step)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def make_optimizer(name, params):
    if name == "lamb":  # large steps: the global-norm clipping (max_grad_norm 1.0) and trust ratios both act
        return FusedLAMB(params, lr=0.05, weight_decay=0.01, max_grad_norm=0.05)
    if name == "novograd":
        return FusedNovoGrad(params, lr=0.05, weight_decay=0.01)
    return FusedAdam(params, lr=0.05, weight_decay=0.01)


def reference(args, data_ranks):
    torch.manual_seed(0)
    model = Net(False)
    opt = make_optimizer(args.optimizer, model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = batch(step, ROWS * data_ranks)
        per_rank = [model(x[r * ROWS:(r + 1) * ROWS], y[r * ROWS:(r + 1) * ROWS]) for r in range(data_ranks)]
        torch.stack(per_rank).mean().backward()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return {"losses": losses, "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="lamb")
    parser.add_argument("--reference", type=int, default=0)
    parser.add_argument("--data-ranks", type=int, default=1)
    args = parser.parse_args()
    out = os.environ["SMP2DS_SCRIPT_OUT"]
    if args.reference:
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(reference(args, args.data_ranks), f)
        return
    smp.init()
    torch.manual_seed(0)
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1):
        net = Net(state.cfg.pipeline_parallel_degree > 1)
    model = smp.DistributedModel(net)
    walked = model.module.module  # every layout here has ddp: SMP's DDP wrapper sits between
    smp.set_activation_checkpointing(walked.up)
    unwrapped = model.module
    while isinstance(unwrapped, DistributedDataParallel):
        unwrapped = unwrapped.module
    opt = smp.DistributedOptimizer(make_optimizer(args.optimizer, model.parameters()))
    split = sorted(n for n, p in model.local_named_parameters() if get_distribution_axis(p) is not None)

    @smp.step
    def train_step(model, x, y):
        loss = model(x, y)
        model.backward(loss)
        return loss

    losses, log = [], []
    for step in range(STEPS):
        x, y = batch(step, ROWS * smp.dp_size())
        rows = slice(smp.dp_rank() * ROWS, (smp.dp_rank() + 1) * ROWS)
        losses.append(train_step(model, x[rows], y[rows]).reduce_mean().item())
        opt.step()
        opt.zero_grad()
        log.append(rmsg(f"step {step} loss {losses[-1]:.4f}"))
    weights = {k: v.flatten().tolist() for k, v in model.state_dict().items()}
    report = {"rank": smp.rank(), "losses": losses, "weights": weights, "log": log, "split": split,
              "microbatches": state.cfg.microbatches, "state_model_is_model": state.model is model,
              "dp_size": smp.dp_size(), "dp_rank": smp.dp_rank(),
              "walked_is_model": walked is model.get_module() and unwrapped is walked,
              "wrapper_is_ddp": isinstance(model.module, DistributedDataParallel)}
    with open(os.path.join(out, f"rank{smp.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
