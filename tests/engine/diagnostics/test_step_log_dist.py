"""``SMP2DS_LOG=info``: a real 2-rank run prints rank-tagged step lines and rank 0's layout line.

Each rank sends its standard error to a file before ``smp.init`` and trains 4 steps of 2
micro-batches; the lines in those files are then checked against the run: step numbers at the
``SMP2DS_LOG_FREQ`` interval, the loss each rank's step returned, and the layout of the plan.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests._dist import run_ranks

STEPS, FREQ, BATCH = 4, 2, 4
LINE = re.compile(r"^\[smp2ds rank (\d)/2\] INFO step (\d+): loss (\S+), step time (\d+\.\d{3}) s$")


def logged_training(log_dir: str, level: str) -> dict:
    import torch
    import torch.nn.functional as F

    import smdistributed.modelparallel.torch as smp
    from tests.engine.workers.train_workers import make_model, rank_batch

    path = os.path.join(log_dir, f"stderr-{os.environ['RANK']}-{level}.txt")
    os.environ.update({"SMP2DS_LOG": level, "SMP2DS_LOG_FREQ": str(FREQ)})
    sys.stderr.flush()
    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    smp.init({"ddp": True, "microbatches": 2})
    model = smp.DistributedModel(make_model(0))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    @smp.step
    def train_step(model, x, y):
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for step in range(STEPS):
        x, y = rank_batch(step, 2, BATCH, smp.rank())
        optimizer.zero_grad()
        out = train_step(model, x, y)
        optimizer.step()
        losses.append(float(out.reduce_mean()))
    sys.stderr.flush()
    with open(path, encoding="utf-8") as handle:
        return {"losses": losses, "stderr": handle.read()}


@pytest.mark.slow
def test_info_logs_steps_on_every_rank_and_the_layout_on_rank_0(tmp_path):
    results = run_ranks(logged_training, 2, str(tmp_path), "info")
    for rank, result in enumerate(results):
        lines = [m.groups() for m in map(LINE.match, result["stderr"].splitlines()) if m]
        assert [int(step) for _, step, _, _ in lines] == [2, 4], result["stderr"]  # every FREQ-th step
        assert {int(r) for r, _, _, _ in lines} == {rank}  # tagged with the rank that wrote it
        for (_, step, loss, seconds) in lines:
            assert float(loss) == pytest.approx(result["losses"][int(step) - 1], rel=1e-5)
            assert 0 < float(seconds) < 60
        layout = [line for line in result["stderr"].splitlines() if " INFO layout: " in line]
        if rank == 0:
            assert layout == [
                "[smp2ds rank 0/2] INFO layout: world 2 = pipeline 1 x tensor 1 x data-parallel 2 "
                "(placement DPT), 1 node(s) x 2 rank(s); DDP; 2 micro-batch(es) per step; fp32; backend gloo"
            ]
        else:
            assert layout == []


def test_settings_are_checked_and_off_by_default():
    from smp2ds.engine.diagnostics import step_log

    assert step_log.configure(0, 2, {}) is False and step_log.step_started() is None
    assert step_log.configure(0, 2, {"SMP2DS_LOG": "warning"}) is False  # step lines are info
    with pytest.raises(ValueError, match=r"SMP2DS_LOG='loud' is not a log level; allowed: debug, info, warning, error"):
        step_log.configure(0, 2, {"SMP2DS_LOG": "loud"})
    with pytest.raises(ValueError, match=r"SMP2DS_LOG_FREQ='0' must be a whole number >= 1"):
        step_log.configure(0, 2, {"SMP2DS_LOG": "info", "SMP2DS_LOG_FREQ": "0"})
    step_log.configure(0, 2, {})
