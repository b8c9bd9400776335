"""Train until step 3, then one rank dies (SIGKILL or an exception): the others must stop."""

import os
import signal
import sys
import time

import torch

import smdistributed.modelparallel.torch as smp

victim, how = int(sys.argv[1]), sys.argv[2]
smp.init({"ddp": True})
model = smp.DistributedModel(torch.nn.Linear(4, 1))
opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))


@smp.step
def train_step(model, x):
    loss = model(x).pow(2).mean()
    model.backward(loss)
    return loss


for step in range(100000):
    if step == 3 and smp.rank() == victim:
        with open(os.environ["FAULT_MARK"], "w") as handle:
            handle.write(str(time.time()))
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("deliberate failure on this rank")
    opt.zero_grad()
    train_step(model, torch.randn(4, 4))
    opt.step()
