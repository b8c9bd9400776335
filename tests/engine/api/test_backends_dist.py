"""The seams to the MiCS and pipeline engines, driven through the unchanged smp.* API.

The MiCS and pipeline packages have their own tests; these check that ``DistributedModel`` /
``DistributedOptimizer`` / ``@smp.step`` / checkpoints route to them correctly: training equals
the plain-PyTorch reference and save -> resume -> continue equals uninterrupted training.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_ranks
from tests.engine.workers import train_workers as tw

B = 8
CASES = {
    # sharded data parallelism, S = 2 = dp: ZeRO-3 over both ranks; SMP's sdp_gradient_clipping
    # default 1.0 is applied by DeepSpeed, so the reference clips at 1.0 too. Ranks start from
    # different weights: the engine must broadcast rank 0's.
    "mics": ({"ddp": True, "sharded_data_parallel_degree": 2, "microbatches": 2}, 2,
             {"optimizer": "adam", "seed": 5, "steps": 3, "engine_clip": 1.0, "probe_capabilities": True}),
    # two pipeline stages, one data-parallel rank (both ranks see the same batch). As in SMP, each
    # stage keeps the layers of its own copy of the model, so the seeds must agree.
    "pipeline": ({"ddp": True, "partitions": 2, "microbatches": 2}, 1,
                 {"optimizer": "adam", "seed": 5, "steps": 3, "same_init": True, "probe_capabilities": True}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_smp_api_on_other_engines_matches_reference(case):
    config, dp, phase = CASES[case]
    per_rank = run_ranks(tw.run_training, 2, config, [phase], B)
    ref = tw.reference(phase, dp, B, config["microbatches"])
    for rank, (got,) in enumerate(per_rank):
        for k, v in ref["weights"].items():
            torch.testing.assert_close(torch.as_tensor(got["weights"][k]), v, rtol=1e-5, atol=1e-6, msg=k)
        data_rank = rank if dp > 1 else 0
        for step, so in enumerate(got["outputs"]):
            assert so["outputs"] == pytest.approx(ref["mb_losses"][step][data_rank], rel=1e-5, abs=1e-7)
        assert got["capabilities"] == CAPABILITIES[case]


# What the core does when it asks the backend (not the configuration): pipeline stages run only inside
# @smp.step; under sharded data parallelism clip_master_grads returns None (DeepSpeed clips in the step);
# the backend built is the one the Plan (and so `smp2ds explain`) names.
CAPABILITIES = {
    "mics": {"forward_outside_step": "ran", "clip_returns_norm": False, "backend_is_the_plans": True},
    "pipeline": {"forward_outside_step": "FwdExecutionNotInStepFnError", "clip_returns_norm": True,
                 "backend_is_the_plans": True},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_resume_on_other_engines(tmp_path, case):
    config = CASES[case][0]
    res = run_ranks(tw.run_checkpoint, 2, config, B, 2, str(tmp_path / "ckpt"))
    for out in res:
        for k, v in out["uninterrupted"].items():
            torch.testing.assert_close(torch.as_tensor(out["resumed"][k]), torch.as_tensor(v), rtol=1e-5, atol=1e-6,
                                       msg=k)
        assert out["user_content"] == {"step": 2}
    files = set(res[0]["files"])
    if case == "mics":
        assert {"model_0.pt", "optimizer_0.pt", "optimizer_1.pt"} <= files  # SMP's sdp layout: one per shard rank
    else:
        assert {"model_0_0.pt", "model_1_0.pt", "optimizer_states_0_0.pt", "optimizer_states_1_0.pt"} <= files
