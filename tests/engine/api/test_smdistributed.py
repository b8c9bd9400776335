"""The drop-in package: import paths real clients use, version, and Hugging Face detection."""

from __future__ import annotations

import os
import subprocess
import sys

from packaging import version


def test_import_paths_clients_use():
    import smdistributed.modelparallel as mp
    import smdistributed.modelparallel.backend.exceptions as backend_exc
    import smdistributed.modelparallel.torch as smp
    import smdistributed.modelparallel.torch.exceptions as torch_exc
    from smp2ds.engine.api.step import StepFunction

    assert version.parse(mp.__version__) >= version.parse("1.10") and mp.__version__.startswith("1.")
    assert smp.model.DistributedModel is smp.DistributedModel
    assert callable(smp.step) and isinstance(smp.step(lambda: None), StepFunction)  # smp.step is the decorator
    assert callable(smp.checkpoint) and smp.amp.GradScaler and smp.nn.DistributedLinear
    assert backend_exc.TensorSplitError is torch_exc.TensorSplitError is smp.exceptions.TensorSplitError
    assert issubclass(torch_exc.SMPValidationError, ValueError) and issubclass(torch_exc.SMPRuntimeError, RuntimeError)
    assert smp.CommGroup.DP_GROUP == 4 and smp.RankType.DP_RANK.get_comm_group() is smp.CommGroup.DP_GROUP
    assert smp.DP_GROUP is smp.CommGroup.DP_GROUP
    for name in ("init", "DistributedOptimizer", "rank", "rdp_size", "get_dp_process_group", "barrier", "broadcast",
                 "send", "recv_from", "allgather", "save", "load", "save_checkpoint", "resume_from_checkpoint",
                 "model_creation", "partition", "set_activation_checkpointing", "state", "reset"):
        assert hasattr(smp, name), name


def test_sizes_are_one_and_ranks_raise_before_init():
    import pytest

    import smdistributed.modelparallel.torch as smp

    if smp.is_initialized():
        pytest.skip("another test initialised SMP in this process")
    assert (smp.pp_size(), smp.tp_size(), smp.dp_size(), smp.rdp_size(), smp.mp_size()) == (1, 1, 1, 1, 1)
    with pytest.raises(smp.exceptions.NotInitializedError, match="smp.init"):
        smp.rank()


def test_transformers_detects_smp_from_the_sagemaker_environment():
    code = ("from transformers.utils.import_utils import is_sagemaker_mp_enabled as f; print(f())")
    env = dict(os.environ, SM_HP_MP_PARAMETERS='{"partitions": 2, "microbatches": 4}',
               SM_FRAMEWORK_PARAMS='{"sagemaker_mpi_enabled": true}')
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                        check=False)
    env["SM_HP_MP_PARAMETERS"] = '{"microbatches": 4}'  # no "partitions": transformers says no
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert on.stdout.strip().splitlines()[-1] == "True", on.stderr[-2000:]
    assert off.stdout.strip().splitlines()[-1] == "False", off.stderr[-2000:]


def test_layering_rules_hold_for_the_engine_core():
    """Only engine/comm.py imports torch.distributed; engine/, translator/ and cli/ never import the drop-in."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[3]
    # comm_counter.py belongs to the MiCS work (it patches torch.distributed to count bytes).
    allowed_dist = {"comm.py", "comm_counter.py"}
    offenders = []
    for path in [*sorted((root / "engine").glob("*.py")), *sorted((root / "translator").rglob("*.py")),
                 *sorted((root / "cli").rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                if name.startswith("smdistributed"):
                    offenders.append(f"{path.name} imports {name}")
                if name.startswith("torch.distributed") and path.parent.name == "engine" and path.name not in allowed_dist:
                    offenders.append(f"{path.name} imports {name}")
    assert not offenders, offenders
