"""Train until step 3, then one rank stops progressing while staying alive (its heartbeat goes on).

``stuck_rank.py VICTIM sleep``: the victim sleeps instead of training; the others wait in the
step's gradient all-reduce. ``stuck_rank.py VICTIM alone``: the victim calls a collective that no
other rank calls (as ``model.state_dict()`` on one rank under sharded data parallelism would),
while the others go on to the next step. Every rank must stop, naming where the victim is.
``stuck_rank.py VICTIM kill``: the victim dies (SIGKILL); ``raise``: it fails with an exception
(the dead-rank tests).
"""

import os
import signal
import sys
import time

import torch

import smdistributed.modelparallel.torch as smp

args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the deepspeed launcher adds it
victim, how = int(args[0]), args[1]
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
        if how == "raise":
            raise ValueError("deliberate failure on this rank")
        if how == "sleep":
            time.sleep(3600)
        else:
            smp.allgather(("only", smp.rank()), smp.WORLD)
    opt.zero_grad()
    train_step(model, torch.randn(4, 4))
    opt.step()
