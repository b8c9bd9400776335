"""Fine-tuning with gradual unfreezing, written the way SMP scripts do it.

The SMP configuration comes from the launcher (``SM_HP_MP_PARAMETERS``). The optimizer starts with the
head only; the last backbone block is unfrozen with ``optimizer.add_param_group`` before training
starts, the first block after the first step. The script's own optimizer class carries a helper
method it calls through the ``DistributedOptimizer``. Each rank writes
``$SMP2DS_SCRIPT_OUT/rank<N>.json``: losses, final weights, and what became of the late unfreeze.
"""

import json
import os

import torch
import torch.nn.functional as F

import smdistributed.modelparallel.torch as smp

STEPS, BATCH = 3, 8
LRS = {"head": 0.1, "block2": 0.05, "block1": 0.02}


class TrackedSGD(torch.optim.SGD):
    """An optimizer with a helper of its own, as scripts' optimizers often have."""

    def group_lrs(self):
        return [g["lr"] for g in self.param_groups]


def make_model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 2))


def dataset(world):
    g = torch.Generator().manual_seed(11)
    return torch.randn(STEPS, world * BATCH, 8, generator=g), torch.randn(STEPS, world * BATCH, 2, generator=g)


@smp.step
def train_step(model, x, y):
    loss = F.mse_loss(model(x), y)
    model.backward(loss)
    return loss


def main():
    smp.init()
    model = smp.DistributedModel(make_model())
    layers = list(model.get_module())
    optimizer = smp.DistributedOptimizer(TrackedSGD(layers[4].parameters(), lr=LRS["head"]))
    optimizer.add_param_group({"params": list(layers[2].parameters()), "lr": LRS["block2"]})
    try:  # a slip: the head is already being trained
        optimizer.add_param_group({"params": list(layers[4].parameters()), "lr": LRS["head"]})
        repeated_group = "added"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        repeated_group = f"{type(exc).__name__}: {exc}"

    x, y = dataset(smp.dp_size())
    rows = slice(smp.dp_rank() * BATCH, (smp.dp_rank() + 1) * BATCH)
    losses, late_unfreeze = [], None
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(train_step(model, x[step, rows], y[step, rows]).reduce_mean().item())
        optimizer.step()
        if step == 0:
            try:
                optimizer.add_param_group({"params": list(layers[0].parameters()), "lr": LRS["block1"]})
                late_unfreeze = "added"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                late_unfreeze = f"{type(exc).__name__}: {exc}"
    report = {"losses": losses, "late_unfreeze": late_unfreeze, "repeated_group": repeated_group, "group_lrs": optimizer.group_lrs(),
              "ds_optimizer": type(optimizer.ds_optimizer).__name__,
              "weights": {k: v.float().flatten().tolist() for k, v in model.state_dict().items()}}
    with open(os.path.join(os.environ["SMP2DS_SCRIPT_OUT"], f"rank{smp.rank()}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
