"""Pin the DeepSpeed internals MiCS relies on, so an upgrade fails here, loudly, not in training.

Each check names the DeepSpeed object and what smp2ds/engine/mics needs from it. Source checks
are used where behaviour (call order) matters and cannot be observed without a process group.
"""

from __future__ import annotations

import inspect

import pytest

deepspeed = pytest.importorskip("deepspeed")


def _src(obj) -> str:
    return inspect.getsource(obj)


def _method_src(cls, name: str) -> str:
    """Source of ``cls.name`` read from the class body (DeepSpeed's nvtx decorator hides the function)."""
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in tree.body[0].body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.unparse(node)
    raise AssertionError(f"{cls.__name__}.{name} no longer exists in deepspeed {deepspeed.__version__}")


def _stage3():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return DeepSpeedZeroOptimizer_Stage3


def test_gradient_partitions_live_in_averaged_gradients_at_step_time():
    cls = _stage3()
    epilogue = _method_src(cls, "independent_gradient_partition_epilogue")
    assert "self.averaged_gradients[i]" in epilogue, (
        "DeepSpeedZeroOptimizer_Stage3.independent_gradient_partition_epilogue no longer fills "
        "averaged_gradients: the MiCS replica all-reduce (engine/mics/gradsync.py) would miss the gradients")
    assert "averaged_gradients" in _method_src(cls, "_get_norm_groups"), (
        "DeepSpeedZeroOptimizer_Stage3._get_norm_groups no longer reads averaged_gradients")
    # Optional fast path (one collective, no copy); gradsync checks storage and size at run time.
    assert "self.grad_partitions_flat_buffer" in _method_src(cls, "_setup_for_real_optimizer"), (
        "DeepSpeedZeroOptimizer_Stage3.grad_partitions_flat_buffer moved: gradsync falls back to a copy")


def test_step_computes_overflow_and_norm_before_clipping_and_update():
    step = _method_src(_stage3(), "step")
    order = ["_overflow_check_and_loss_scale_update", "_get_norm_groups", "unscale_and_clip_grads",
             "_optimizer_step"]
    positions = [step.find(name) for name in order]
    assert all(p >= 0 for p in positions) and positions == sorted(positions), (
        f"DeepSpeedZeroOptimizer_Stage3.step changed (expected {order} in this order, found at {positions}); "
        "the MiCS replica all-reduce wraps step() and must run before the norm and the update")
    assert "averaged_gradients" not in step.split("_get_norm_groups")[0], (
        "step() touches averaged_gradients before the norm: re-check where the replica all-reduce belongs")


def test_reduced_partitions_pass_through_partition_grads_into_the_views_averaged_gradients_lists():
    # What engine/mics/overlap.py relies on: (method, code it must contain, what breaks without it).
    from deepspeed.runtime.engine import DeepSpeedEngine

    cls = _stage3()
    views = "self.__param_id_to_grad_partition[param.ds_id]"  # read by overlap.py as VIEWS_ATTR
    expected = [
        ("__reduce_and_partition_ipg_grads", "self.partition_grads(params_in_bucket, grad_partitions)",
         "ZeRO-3's bucket reduce no longer calls partition_grads: no replica all-reduce would be overlapped"),
        ("partition_grads", views, "partition_grads no longer writes into __param_id_to_grad_partition"),
        ("independent_gradient_partition_epilogue", views,
         "averaged_gradients no longer lists the __param_id_to_grad_partition views"),
        ("_setup_for_real_optimizer", f"{views} = self.grad_partitions_flat_buffer.narrow(",
         "__param_id_to_grad_partition no longer views grad_partitions_flat_buffer"),
    ]
    for method, code, broken in expected:
        assert code in _method_src(cls, method), f"DeepSpeedZeroOptimizer_Stage3.{method}: {broken} (overlap.py)"
    engine = _src(DeepSpeedEngine)
    # A new backward drops copies taken in one not followed by step (ReplicaOverlap.discard), and
    # ZeRO-3 is told the boundary before backward (only a boundary backward issues all-reduces).
    assert "self.optimizer.backward_prologue()" in engine
    assert "self.optimizer.set_gradient_accumulation_boundary(self.is_gradient_accumulation_boundary())" in engine


def test_parameter_fetch_goes_through_dist_allgather_fn():
    from deepspeed.runtime.zero import partition_parameters as pp

    params = list(inspect.signature(pp._dist_allgather_fn).parameters)
    assert params[:3] == ["input_tensor", "output_tensor", "group"], params
    convert = _method_src(pp.Init, "_convert_to_deepspeed_param")
    assert convert.count("_dist_allgather_fn(") >= 2, (
        "ZeRO-3 fetches no longer call partition_parameters._dist_allgather_fn: the hierarchical "
        "all-gather (engine/mics/allgather.py) would be bypassed")


def test_module_apply_rebroadcast_still_uses_src_zero_and_dist_module():
    from deepspeed.runtime.zero import partition_parameters as pp

    assert hasattr(pp, "dist") and hasattr(pp.dist, "broadcast")
    # zero.Init's Module.apply wrapper re-broadcasts from src=0, a *global* rank not in shard groups
    # 1..R-1; mics_init_context translates it (when DeepSpeed fixes this, the translation is a no-op).
    assert "dist.broadcast(param.data.view(torch.uint8), 0, group=param.ds_process_group)" in inspect.getsource(pp)


def test_engine_checkpoint_writer_flags_exist():
    from deepspeed.runtime.engine import DeepSpeedEngine

    src = _src(DeepSpeedEngine)
    for flag in ("self.save_non_zero_checkpoint", "self.save_zero_checkpoint"):
        assert flag in src, f"DeepSpeedEngine lost {flag}: only the first MiCS shard group must write files"


def test_groups_take_data_parallel_group_from_mpu():
    from deepspeed.utils import groups

    assert "mpu.get_data_parallel_group()" in _src(groups._get_data_parallel_group)
    assert "mpu.get_data_parallel_world_size()" in _src(groups._get_data_parallel_world_size)


def test_check_stage3_internals_rejects_other_optimizers_with_a_clear_message():
    import torch

    from smp2ds.engine.mics import DeepSpeedInternalsChanged, check_stage3_internals

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(DeepSpeedInternalsChanged, match=r"ZeRO-3 optimizer .*averaged_gradients.*SGD"):
        check_stage3_internals(opt)
