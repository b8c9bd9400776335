"""Checkpoint crash tests, run as real rank processes by tests/engine/core/test_checkpoint_atomic_dist.py.

``ckpt_fault.py save CKPT TAG2``: train 2 steps, save tag ``a`` (complete), train 2 more,
write the expected states to ``CKPT.refs``, then save TAG2 with ``SMP2DS_FAULT_POINT`` set from
``ARM_FAULT`` (so only the second save can be killed).

``ckpt_fault.py verify CKPT...``: for every CKPT, resume the newest checkpoint (and tag ``b``)
into a fresh model and optimizer and print one JSON line per case saying which saved step the
weights, the optimizer state and the user content came from (they must agree); then save tag
``c`` there and list what is left in the directory (leftovers of the crash must be gone).
"""

import json
import os
import sys

import torch

import smdistributed.modelparallel.torch as smp

CONFIG = {"ddp": True, "shard_optimizer_state": True}


def fresh(seed):
    smp.reset()
    torch.manual_seed(seed)
    model = smp.DistributedModel(torch.nn.Linear(4, 2))
    return model, smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.05))


@smp.step
def train_step(model, x):
    loss = model(x).pow(2).mean()
    model.backward(loss)
    return loss


def train(model, opt, first, count):
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(100 * step + smp.rank())
        opt.zero_grad()
        train_step(model, torch.randn(4, 4, generator=g))
        opt.step()


def snapshot(model, opt):
    return {"model": model.state_dict(), "opt": opt.local_state_dict()}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and not callable(a):  # e.g. DeepSpeed's loss-scaler object
        return type(a) is type(b) and same(vars(a), vars(b))
    return a == b


def save_run(ckpt, tag2):
    refs = ckpt + ".refs"
    os.makedirs(refs, exist_ok=True)
    model, opt = fresh(1)
    train(model, opt, 0, 2)
    torch.save(snapshot(model, opt), os.path.join(refs, f"ref_2_{smp.rank()}.pt"))
    smp.save_checkpoint(ckpt, "a", model=model, optimizer=opt, user_content={"step": 2},
                        num_kept_partial_checkpoints=1)
    train(model, opt, 2, 2)
    torch.save(snapshot(model, opt), os.path.join(refs, f"ref_4_{smp.rank()}.pt"))
    os.environ["SMP2DS_FAULT_POINT"] = os.environ.get("ARM_FAULT", "")
    smp.save_checkpoint(ckpt, tag2, model=model, optimizer=opt, user_content={"step": 4},
                        num_kept_partial_checkpoints=1)
    print("SAVE-COMPLETED", flush=True)


def resume_case(ckpt, tag):
    refs = ckpt + ".refs"
    model, opt = fresh(99)
    try:
        content = smp.resume_from_checkpoint(ckpt, tag=tag)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    now = snapshot(model, opt)
    found = {}
    for step in (2, 4):
        ref = torch.load(os.path.join(refs, f"ref_{step}_{smp.rank()}.pt"), weights_only=False)
        if same(ref["model"], now["model"]):
            found["model"] = step
        if same(ref["opt"]["ds_optimizer"], now["opt"]["ds_optimizer"]):
            found["opt"] = step
    return {"user_content": (content or {}).get("step"), **found}


def verify_run(ckpts):
    for ckpt in ckpts:
        result = {"ckpt": ckpt, "newest": resume_case(ckpt, None), "b": resume_case(ckpt, "b")}
        model, opt = fresh(5)
        smp.save_checkpoint(ckpt, "c", model=model, optimizer=opt, num_kept_partial_checkpoints=1)
        result["after_next_save"] = sorted(os.listdir(ckpt))
        if smp.rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)


smp.init(CONFIG)
if sys.argv[1] == "save":
    save_run(sys.argv[2], sys.argv[3])
else:
    verify_run(sys.argv[2:])
