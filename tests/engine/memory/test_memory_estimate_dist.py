"""``smp2ds explain --memory`` against the measured peak of real training steps on two CPU ranks.

Each rank runs the engine for two steps under a counter of live tensor storages (``tests/engine/workers/memory_workers``,
independent of the tracer the estimate uses); its peak must be within 10 % of the estimate for its role. Rows:
a pipeline with two micro-batches in flight on its first stage, tensor parallelism with activation
checkpointing, and sharded data parallelism (ZeRO-3 over 2 ranks) with every parameter over 1000 elements
gathered and small reduce buckets (the full table is ``bench/memory_estimate_accuracy.py``'s); and LLaMA's last
pipeline stage with checkpointing at batch 8 x 256, where DeepSpeed kept the previous micro-batch's logits alive at
the stage's peak until the engine let go of them (11 % over the estimate before).
"""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.engine.workers import memory_workers as rows


@pytest.mark.slow
@pytest.mark.parametrize("family,layout,ckpt,batch,seq", [
    ("gpt2", "pp2", False, rows.BATCH, rows.SEQ), ("llama", "tp2", True, rows.BATCH, rows.SEQ),
    ("gpt2", "sdp2small", False, rows.BATCH, rows.SEQ), ("llama", "pp2", True, 8, 256)])
def test_estimate_is_within_ten_percent_of_the_measured_peak_of_every_rank(tmp_path, family, layout, ckpt, batch,
                                                                           seq):
    path = rows.write_config(family, str(tmp_path / f"{family}.json"))
    roles = rows.estimated_roles(layout, ckpt, path, batch=batch, seq=seq)
    measured = run_ranks(rows.measured_peak, 2, family, layout, ckpt, path, batch, seq)
    assert len({m["pp_rank"] for m in measured}) == len(roles)  # every role measured
    for m in measured:
        estimate = roles[m["pp_rank"]]["total"]
        assert abs(estimate / m["measured"] - 1) < 0.10, (m, estimate)
