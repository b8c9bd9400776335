"""Resuming never runs code hidden in a checkpoint (real processes, gloo).

Every way the runtime reads a checkpoint (``smp.resume_from_checkpoint`` full and partial, ``smp.load``) and
the offline tools (``smp2ds checkpoint``) read with ``weights_only=True``: a file whose unpickling would create
a marker file is refused, naming what it references and the switch that trusts a checkpoint, and the marker
never appears. What SMP scripts put in ``user_content`` (Hugging Face configs, ``argparse.Namespace``, numpy
scalars and arrays, LR-scheduler state) and the optimizer state DeepSpeed writes (plain DDP and ZeRO-1) resume
without the switch. A harmless type outside that list loads only when trusted.
"""

from __future__ import annotations

import fractions
import os

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.engine.workers.safe_load_workers import Hostile, run_safe_loading


@pytest.mark.slow
@pytest.mark.parametrize("shard_optimizer_state", [False, True])
def test_resume_reads_what_scripts_save_and_refuses_code(tmp_path, shard_optimizer_state):
    per_rank = run_ranks(run_safe_loading, 2, str(tmp_path), shard_optimizer_state)
    for rank, out in enumerate(per_rank):
        for content in (out["content"], out["full_content"]):
            assert vars(content["args"]) == {"lr": 0.1, "model": "tiny"}
            assert content["config"].n_layer == 2 and type(content["config"]).__name__ == "GPT2Config"
            assert content["loss"] == np.float64(1.5) and list(content["tokens"]) == [0, 1, 2]
            assert content["scheduler"]["step_size"] == 3 and content["step"] == 1
        for name, message in out["refused"].items():
            assert message is not None, f"rank {rank}: {name} loaded a hostile file"
            assert "io.open" in message and "SMP2DS_TRUST_CHECKPOINTS=1" in message, (name, message)
        assert not out["marker_after_refusals"], f"rank {rank}: a refused checkpoint ran code"
        assert "fractions.Fraction" in out["fraction_refused"]
        assert out["fraction_trusted"] == out["fraction_by_environment"] == {"ratio": fractions.Fraction(1, 3)}
    assert not any(p.name.startswith("pwned") for p in tmp_path.iterdir())


def test_offline_checkpoint_tools_refuse_code_too(tmp_path, capsys):
    from smp2ds.cli import main

    marker = tmp_path / "pwned"
    folder = tmp_path / "ckpt_partial"
    folder.mkdir()
    torch.save({"0.weight": Hostile(str(marker))}, folder / "model_0_0.pt")
    code = main(["checkpoint", "consolidate", str(tmp_path), "--tag", "ckpt", "--out", str(tmp_path / "out.pt")])
    assert code != 0 and not os.path.exists(marker)
    assert "weights_only" in capsys.readouterr().err
