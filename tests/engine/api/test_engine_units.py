"""Single-process unit tests: launcher detection, config merging, DeepSpeed config, model I/O."""

from __future__ import annotations

import pytest
import torch

from smp2ds.engine.api.init import merged_config
from smp2ds.engine.core import deepspeed_config as dsc
from smp2ds.engine.core import model_io
from smp2ds.engine.core.launch_env import LaunchEnvError, detect
from smp2ds.translator.issues import SMPConfigError


def test_torchrun_environment_uses_the_agent_store():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "1"}
    le = detect(env)
    assert (le.launcher, le.rank, le.world_size, le.local_rank, le.local_size, le.nodes) == ("torchrun", 3, 4, 1, 2, 2)
    assert le.rendezvous.agent_store and le.rendezvous.port == 29500 and "attempt_1" in le.rendezvous.prefix


def test_deepspeed_launcher_and_ddp_port_override():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    le = detect(env)
    assert le.launcher == "deepspeed" and le.local_size == 2 and le.rendezvous.port == 29500
    assert detect(env, ddp_port=31000).rendezvous.port == 31000  # SMP: ddp_port overrides the port


def test_mpirun_chooses_its_own_rendezvous():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1116798977",
           "OMPI_MCA_orte_hnp_uri": "1116798976.0;tcp://192.0.2.2:53751;tcp6://[fd00::2]:52209"}
    le = detect(env)
    assert le.launcher == "mpirun" and (le.rank, le.world_size, le.local_rank, le.local_size) == (1, 4, 1, 2)
    assert le.rendezvous.host == "192.0.2.2" and le.rendezvous.port == 20000 + 1116798977 % 10000
    single_node = detect({**env, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert single_node.rendezvous.host == "127.0.0.1"
    assert detect({**env, "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}).rendezvous.describe() == \
        "tcp://h0:1234 (store hosted by rank 0)"


def test_single_process_and_test_harness_file_rendezvous():
    le = detect({})
    assert le.launcher == "single" and le.world_size == 1 and le.rendezvous.kind == "file"
    le = detect({"RANK": "0", "WORLD_SIZE": "2", "SMP2DS_INIT_METHOD": "file:///tmp/x/rdv"})
    assert le.rendezvous.path == "/tmp/x/rdv"


def test_launch_env_errors_say_what_is_missing():
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR/MASTER_PORT are not"):
        detect({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchEnvError, match="rank 5 is outside the world of 2"):
        detect({"RANK": "5", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})


def test_env_parameters_override_the_script_dict_key_by_key():
    env = {"SM_HP_MP_PARAMETERS": '{"microbatches": 4, "ddp": true}'}
    assert merged_config({"microbatches": 2, "fp16": True}, env) == {"microbatches": 4, "fp16": True, "ddp": True}
    with pytest.raises(SMPConfigError, match="SM_HP_MP_PARAMETERS is not valid JSON"):
        merged_config({}, {"SM_HP_MP_PARAMETERS": "{bad"})
    with pytest.raises(SMPConfigError, match="must hold a JSON object"):
        merged_config({}, {"SM_HP_MP_PARAMETERS": "[1]"})


def test_fp16_block_maps_smp_loss_scaling_arguments():
    assert dsc.fp16_block(dsc.LossScaleArgs()) == {"loss_scale": 1.0}  # SMP default: static scale 1
    block = dsc.fp16_block(dsc.LossScaleArgs(None, True, {"scale_window": 500, "min_scale": 2, "delayed_shift": 2,
                                                         "init_scale": 2.0 ** 16}))
    assert block == {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 500, "min_loss_scale": 2.0,
                     "hysteresis": 2, "consecutive_hysteresis": False}
    with pytest.raises(ValueError, match="unknown key"):
        dsc.fp16_block(dsc.LossScaleArgs(None, True, {"window": 1}))


def test_engine_config_keeps_the_plan_and_adds_bookkeeping():
    plan = {"train_batch_size": 64, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1},
            "fp16": {"enabled": True, "loss_scale": 0}}
    ds = dsc.engine_config(plan, microbatches=2, loss_scale=dsc.LossScaleArgs(128.0))
    assert "train_batch_size" not in ds and ds["train_micro_batch_size_per_gpu"] == 1
    assert ds["zero_optimization"] == {"stage": 1, "overlap_comm": False} and ds["fp16"]["loss_scale"] == 128.0
    assert dsc.precision(ds) == "fp16" and dsc.zero_stage(ds) == 1 and plan["zero_optimization"] == {"stage": 1}
    from deepspeed.runtime.config import DeepSpeedConfig

    DeepSpeedConfig(dsc.engine_config({"zero_optimization": {"stage": 0}}, microbatches=4))  # DeepSpeed accepts it


def test_scalar_for_backward_reproduces_vector_jacobian_products():
    w = torch.randn(3, requires_grad=True)
    out, g = w * torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, -1.0, 2.0])
    model_io.scalar_for_backward(out, g).backward()
    expected = torch.tensor([1.0, 2.0, 3.0]) * g
    assert torch.equal(w.grad, expected)
    with pytest.raises(ValueError, match="needs grad_tensors"):
        model_io.scalar_for_backward(out)


def test_cast_floating_only_touches_floating_tensors():
    tree = {"a": torch.ones(2), "i": torch.ones(2, dtype=torch.long), "t": (torch.ones(1, dtype=torch.half), 3)}
    half = model_io.cast_floating(tree, torch.float16)
    assert half["a"].dtype == torch.float16 and half["i"].dtype == torch.long and half["t"][1] == 3
    back = model_io.cast_floating(half, torch.float32, only=torch.float16)
    assert back["a"].dtype == torch.float32 and back["t"][0].dtype == torch.float32
    assert model_io.strip_markers({"_smp_is_partial": True, "w": 1}) == {"w": 1}


@pytest.mark.parametrize(("params", "sharded"), [
    ({"ddp": True}, False),
    ({"ddp": True, "shard_optimizer_state": True}, True),
    ({"ddp": True, "sharded_data_parallel_degree": 2}, True),
])
def test_shard_optimizer_state_reads_whether_the_run_shards_the_optimizer_state(params, sharded):
    """Scripts (Hugging Face's Trainer) decide from smp.state.cfg.shard_optimizer_state whether every rdp rank
    saves its own optimizer part; under sharded data parallelism it must read True. The config as given is kept."""
    from smp2ds.engine.core.state import ConfigView
    from smp2ds.translator import normalize
    from smp2ds.translator.plan_types import Layout

    view = ConfigView(normalize(params, Layout(world_size=2)), None)
    assert view.shard_optimizer_state is sharded
    assert view.get_config_dict()["shard_optimizer_state"] is params.get("shard_optimizer_state", False)


def test_ranks_per_node_is_read_in_one_place_for_every_launcher():
    """``launch_env.ranks_per_node``: what ``detect`` records as the local size and what MiCS's groups use when
    ``smp.init`` is not told (the hierarchical all-gather's node boundaries)."""
    import pytest

    from smp2ds.engine.core import launch_env

    assert launch_env.ranks_per_node({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_WORLD_SIZE": "8"}) == 8
    assert launch_env.ranks_per_node({"CROSS_RANK": "0", "LOCAL_SIZE": "4", "RANK": "0"}) == 4  # deepspeed
    assert launch_env.ranks_per_node({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                      "LOCAL_WORLD_SIZE": "9"}) == 2  # mpirun: Open MPI's own
    assert launch_env.ranks_per_node({"MPI_LOCALNRANKS": "6"}) == 6 and launch_env.ranks_per_node({}) is None
    with pytest.raises(launch_env.LaunchEnvError, match="LOCAL_WORLD_SIZE='eight'"):
        launch_env.ranks_per_node({"LOCAL_WORLD_SIZE": "eight"})
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launch_env.detect(env).local_size == launch_env.ranks_per_node(env) == 4
