"""An SMP MNIST-style pipeline script, run unchanged by the script tests (never edited for smp2ds).

Written as SMP's MNIST example and CI test are: a ``GroupedNet`` whose ``forward`` chains two
custom children (``net1`` convolutions, ``net2`` dense layers; ``--model skip``: ``net2`` also
takes the raw image), ``smp.init()`` from the
SageMaker environment, ``smp.DistributedModel`` / ``smp.DistributedOptimizer``, an ``@smp.step``
train step, data loaded on ``pp_rank 0`` only and empty dummies on the other stages, optional
gradient clipping with ``optimizer.clip_master_grads`` and an evaluation step. Synthetic data
(no downloads), 14x14 "images". Writes ``rank<N>.json`` into ``$SMP2DS_SCRIPT_OUT``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import smdistributed.modelparallel.torch as smp

PER_RANK = 8  # rows per data-parallel rank and step


class Net1(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = self.conv2(x)
        x = F.max_pool2d(F.relu(x), 2)
        return torch.flatten(x, 1)


class Net2(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(200, 16)
        self.dropout = nn.Dropout(0.0)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = self.dropout(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


class SkipNet2(Net2):
    """``Net2`` that also sees the raw image: the input data crosses to the second stage."""

    def __init__(self):
        super().__init__()
        self.skip = nn.Linear(196, 10)

    def forward(self, h, x):
        h = self.dropout(F.relu(self.fc1(h)))
        return F.log_softmax(self.fc2(h) + self.skip(torch.flatten(x, 1)), dim=1)


class SkipNet(nn.Module):
    def __init__(self, contexts: bool = False):
        super().__init__()
        if contexts:
            with smp.partition(0):
                self.net1 = Net1()
            with smp.partition(1):
                self.net2 = SkipNet2()
        else:
            self.net1 = Net1()
            self.net2 = SkipNet2()

    def forward(self, x):
        return self.net2(self.net1(x), x)


class GroupedNet(nn.Module):
    def __init__(self, contexts: bool = False):
        super().__init__()
        if contexts:  # SMP's MNIST example: manual placement while building
            with smp.partition(0):
                self.net1 = Net1()
            with smp.partition(1):
                self.net2 = Net2()
        else:
            self.net1 = Net1()
            self.net2 = Net2()

    def forward(self, x):
        return self.net2(self.net1(x))


MODELS = {"grouped": GroupedNet, "skip": SkipNet}


def global_batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step's data over all data-parallel ranks; rank r takes rows block r."""
    g = torch.Generator().manual_seed(1000 + step)
    n = dp * PER_RANK
    return torch.randn(n, 1, 14, 14, generator=g), torch.randint(0, 10, (n,), generator=g)


def make_optimizer(name: str, params):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@smp.step
def train_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(loss)
    return output, loss


@smp.step
def test_step(model, data, target):
    output = model(data)
    return F.nll_loss(output, target, reduction="sum")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--partition", choices=["auto", "contexts"], default="auto")
    parser.add_argument("--model", choices=sorted(MODELS), default="grouped")
    parser.add_argument("--clip", type=float, default=0.0)
    args = parser.parse_args()

    smp.init()
    torch.manual_seed(0)
    model = MODELS[args.model](contexts=args.partition == "contexts")
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(make_optimizer(args.optimizer, model.parameters()))

    losses, norms = [], []
    for step in range(args.steps):
        if smp.pp_rank() == 0:  # only the first stage loads data
            data, target = global_batch(step, smp.dp_size())
            rows = slice(smp.dp_rank() * PER_RANK, (smp.dp_rank() + 1) * PER_RANK)
            data, target = data[rows], target[rows]
        else:
            data, target = torch.empty(0), torch.empty(0, dtype=torch.long)
        optimizer.zero_grad()
        _, loss_mb = train_step(model, data, target)
        if args.clip:
            norms.append(float(optimizer.clip_master_grads(args.clip)))
        optimizer.step()
        losses.append([float(x) for x in loss_mb.outputs])

    model.eval()
    if smp.pp_rank() == 0:
        data, target = global_batch(99, smp.dp_size())
        rows = slice(smp.dp_rank() * PER_RANK, (smp.dp_rank() + 1) * PER_RANK)
        data, target = data[rows], target[rows]
    else:
        data, target = torch.empty(0), torch.empty(0, dtype=torch.long)
    with torch.no_grad():
        eval_loss = float(test_step(model, data, target).reduce_sum())

    result = {"rank": smp.rank(), "pp_rank": smp.pp_rank(), "dp_rank": smp.dp_rank(), "losses": losses,
              "norms": norms, "eval_loss": eval_loss,
              "local_modules": sorted(name for name, m in model.get_module().named_modules()
                                      if any(m is lm for lm in model.local_modules())),
              "state": {k: v.tolist() for k, v in model.state_dict().items()}}
    with open(os.path.join(os.environ["SMP2DS_SCRIPT_OUT"], f"rank{smp.rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
