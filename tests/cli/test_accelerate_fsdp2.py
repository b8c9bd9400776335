"""``convert --to accelerate`` for sharded data and tensor parallelism: FSDP2 on accelerate's ParallelismConfig.

The YAML goes through accelerate's own code: its launch parser reads the file (``launch_command_parser`` +
``_validate_launch_command``), ``prepare_multi_gpu_env`` turns it into the environment its workers get, and its
``ParallelismConfig`` built from that environment has the mesh whose groups are checked against smp2ds's own
topology: the shard groups of ``sharded_data_parallel_degree`` are FSDP2's ``dp_shard`` groups, its replica groups the
``dp_replicate`` groups, the tensor-parallel groups the ``tp`` groups (same ranks). accelerate 1.15 refuses FSDP and
ParallelismConfig on CPU ranks (``MULTI_CPU``), so the launch itself is not run here; what ``accelerator.prepare``
does with the file (accelerate's mesh, ``fully_shard`` on its FSDP dimensions) is run by hand on 4 gloo ranks and
trains like one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from smp2ds.cli import main
from smp2ds.translator.topology import Topology
from tests._dist import run_ranks

pytest.importorskip("accelerate.parallelism_config")  # accelerate >= 1.10


def _groups(mesh_names: tuple[str, ...], shape: tuple[int, ...], dim: str) -> list[list[int]]:
    """The rank groups along ``dim`` of a row-major mesh (how torch's DeviceMesh numbers ranks)."""
    import numpy as np

    grid = np.arange(int(np.prod(shape))).reshape(shape)
    axis = mesh_names.index(dim)
    moved = np.moveaxis(grid, axis, -1).reshape(-1, shape[axis])
    return sorted(sorted(int(r) for r in row) for row in moved)


def _accelerate_env(yaml_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], object]:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(yaml_path), "train.py"])
    _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from accelerate.parallelism_config import ParallelismConfig

    return env, ParallelismConfig()


def _convert(tmp_path: Path, params: dict, world: int, capsys: pytest.CaptureFixture) -> Path:
    source, out = tmp_path / "smp.json", tmp_path / "run.yaml"
    source.write_text(json.dumps(params), encoding="utf-8")
    assert main(["convert", str(source), "--to", "accelerate", "--world-size", str(world), "-o", str(out)]) == 0
    assert "FSDP2, ParallelismConfig" in capsys.readouterr().err
    assert not (tmp_path / "run.deepspeed.json").exists()  # DeepSpeed's plugin is not used
    return out


def test_sharded_data_parallelism_is_fsdp2s_replicate_by_shard_mesh_with_smps_groups(tmp_path, capsys, monkeypatch):
    out = _convert(tmp_path, {"ddp": True, "sharded_data_parallel_degree": 2, "bf16": True}, 4, capsys)
    text = out.read_text()
    assert "# mesh: dp_replicate 2 x dp_shard 2 x tp 1 = 4 ranks" in text
    env, config = _accelerate_env(out, monkeypatch)
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"], env["ACCELERATE_MIXED_PRECISION"]) == ("true", "2", "bf16")
    assert (env["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"], env["PARALLELISM_CONFIG_DP_SHARD_SIZE"]) == ("2", "2")
    names, shape = config._get_mesh()
    assert config.total_size == 4 and names == ("dp_replicate", "dp_shard")
    topo = Topology.for_world(4, pp=1, tp=1)
    assert _groups(names, shape, "dp_shard") == sorted(sorted(g) for g in topo.shard_groups(2))
    assert _groups(names, shape, "dp_replicate") == sorted(sorted(g) for g in topo.replica_groups(2))


@pytest.mark.slow
def test_fsdp2_on_the_converted_mesh_trains_like_one_process_with_smps_groups(tmp_path, capsys, monkeypatch):
    """sdp 2 on 4 ranks -> the YAML -> accelerate's launch environment -> on each of 4 ranks accelerate's own
    ``ParallelismConfig`` builds the mesh and FSDP2 shards a GPT-2 on its ``dp_replicate`` x ``dp_shard``
    dimensions as ``accelerator.prepare`` does: 3 AdamW steps give the single process's losses and weights (the
    engine's sharded data parallelism is held to single-process references in tests/engine/mics/), each rank
    holds half of each parameter, and the shard and replica groups are SMP's."""
    from tests.engine.workers import checkpoint_export_workers as cew

    out = _convert(tmp_path, {"ddp": True, "sharded_data_parallel_degree": 2}, 4, capsys)
    env, _ = _accelerate_env(out, monkeypatch)
    assert env["FSDP_RESHARD_AFTER_FORWARD"].lower() == "true"
    got = run_ranks(cew.fsdp2_on_accelerates_mesh, 4, 3,
                    env={k: v for k, v in env.items() if k.startswith("PARALLELISM_CONFIG_")})
    topo = Topology.for_world(4, pp=1, tp=1)
    for rank, result in enumerate(got):
        assert result["groups"]["dp_shard"] == next(sorted(g) for g in topo.shard_groups(2) if rank in g)
        assert result["groups"]["dp_replicate"] == next(sorted(g) for g in topo.replica_groups(2) if rank in g)
    want = cew.reference(None, steps=3)
    assert got[0]["shard_rows"] * 2 == want["weights"]["transformer.wte.weight"].shape[0]
    np.testing.assert_allclose([r["losses"] for r in got], [want["losses"]] * 4, rtol=1e-5)
    weights = got[0]["state_dict"]
    assert set(weights) == set(want["weights"])
    for name, value in want["weights"].items():
        np.testing.assert_allclose(weights[name], value.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


def test_tensor_parallelism_is_tp_size_on_the_same_ranks(tmp_path, capsys, monkeypatch):
    out = _convert(tmp_path, {"ddp": True, "tensor_parallel_degree": 2}, 4, capsys)
    text = out.read_text()
    assert "tp_plan" in text  # the model must have one: said in the file
    assert "differs from SMP: the 2 data-parallel replicas of each tensor-parallel shard are FSDP2-sharded" in text
    env, config = _accelerate_env(out, monkeypatch)
    assert env["PARALLELISM_CONFIG_TP_SIZE"] == "2" and env["ACCELERATE_MIXED_PRECISION"] == "no"
    names, shape = config._get_mesh()
    assert names == ("dp_shard", "tp") and shape == (2, 2)
    topo = Topology.for_world(4, pp=1, tp=2)
    by_tp_group: dict[tuple[int, ...], list[int]] = {}
    for rank in range(4):
        by_tp_group.setdefault((topo.coords(rank).pp_rank, topo.coords(rank).rdp_rank), []).append(rank)
    assert _groups(names, shape, "tp") == sorted(by_tp_group.values())


def test_plain_data_parallelism_keeps_deepspeeds_plugin(tmp_path, capsys):
    """Data parallelism and ZeRO-1 are exact under DeepSpeed's plugin (run by test_convert_launchers.py)."""
    source, out = tmp_path / "smp.json", tmp_path / "run.yaml"
    source.write_text(json.dumps({"ddp": True, "shard_optimizer_state": True}), encoding="utf-8")
    assert main(["convert", str(source), "--to", "accelerate", "--world-size", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    assert 'distributed_type: "DEEPSPEED"' in out.read_text()
    assert os.path.isfile(tmp_path / "run.deepspeed.json")
