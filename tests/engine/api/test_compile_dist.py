"""``SMP2DS_COMPILE=1`` (an smp2ds setting): DeepSpeed's ``engine.compile()`` gives the eager losses.

Real ranks (tests/_dist.py, gloo), a small fp32 model and three steps: torch.compile on CPU compiles C++ and
is slow, so the model stays tiny. Compiled kernels may sum in another order, hence a tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._dist import run_ranks
from tests.engine.workers import compile_workers as cw

CONFIG = {"ddp": True, "microbatches": 2}
B, STEPS = 4, 3


@pytest.mark.slow
def test_compiled_steps_give_the_eager_losses():
    eager = run_ranks(cw.run_steps, 2, CONFIG, B, STEPS)
    compiled = run_ranks(cw.run_steps, 2, CONFIG, B, STEPS, env={"SMP2DS_COMPILE": "1"}, timeout_s=600)
    for e, c in zip(eager, compiled):
        assert e["compiled"] is False and c["compiled"] is True
        np.testing.assert_allclose(c["losses"], e["losses"], rtol=1e-5, atol=1e-7)
        for key in e["weights"]:
            np.testing.assert_allclose(c["weights"][key], e["weights"][key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_bad_value_names_the_variable():
    from tests._dist import RankFailed

    with pytest.raises(RankFailed, match=r"SMP2DS_COMPILE='yes' is not one of 0, 1"):
        run_ranks(cw.init_only, 2, CONFIG, env={"SMP2DS_COMPILE": "yes"})  # refused at smp.init


@pytest.mark.slow
def test_pipelines_are_refused_at_init():
    from tests._dist import RankFailed

    with pytest.raises(RankFailed, match=r"SMP2DS_COMPILE=1 with pipeline_parallel_degree > 1"):
        run_ranks(cw.init_only, 2, {"ddp": True, "partitions": 2, "microbatches": 2}, env={"SMP2DS_COMPILE": "1"})
