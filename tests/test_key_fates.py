"""A key's reported fate is runtime truth: every "mapped" / "engine" fate names its evidence.

``smp2ds explain`` tells users what happens to each SMP key. A key may claim ``mapped`` or
``engine`` (in any of its keymap rules) only if a test shows its effect at run time: a value
read back from DeepSpeed's running engine, a different schedule or split, fewer bytes held, or
equivalence with a reference run that depends on it. ``EVIDENCE`` names those tests; this file
fails when a claimed key has none, or when a named test no longer exists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from smp2ds.translator.keymap import KEYMAP_V1, KEYMAP_V2

ROOT = Path(__file__).resolve().parent.parent

EVIDENCE: dict[str, tuple[str, ...]] = {
    "pipeline_parallel_degree": ("tests/engine/pipeline/test_pipeline_dist.py::test_pp2_on_two_ranks_matches_single_process_training",),
    "partitions": ("tests/engine/api/test_backends_dist.py::test_smp_api_on_other_engines_matches_reference",),
    "sharded_data_parallel_degree": (
        "tests/engine/mics/test_mics_smp_api.py::test_smp_script_with_delayed_sharded_parameters_matches_single_process",
        "tests/engine/mics/test_mics_dist.py::test_each_rank_holds_one_over_s_of_params_grads_and_optimizer_state",
        "tests/engine/tensor_parallel/test_tp_sdp_dist.py::test_tp2_sdp2_delayed_init_trains_like_single_process_and_holds_a_quarter",
    ),
    "microbatches": ("tests/engine/api/test_key_effects_dist.py::test_mapped_keys_reach_the_running_deepspeed_engine",
                     "tests/engine/api/test_train_dist.py::test_training_equals_single_process_reference"),
    "active_microbatches": ("tests/engine/pipeline/test_pipeline_units.py::test_settings_follow_the_plan_schedule_decision",
                            "tests/engine/pipeline/test_pipeline_units.py::test_schedules_run_without_deadlock_and_respect_the_in_flight_cap"),
    "pipeline": ("tests/engine/pipeline/test_pipeline_dist.py::test_pp2_on_two_ranks_matches_single_process_training",
                 "tests/engine/pipeline/test_pipeline_units.py::test_settings_follow_the_plan_schedule_decision"),
    "placement_strategy": ("tests/engine/api/test_api_dist.py::test_every_smp_group_connects_the_ranks_the_topology_names",),
    "auto_partition": ("tests/engine/pipeline/test_pipeline_dist.py::test_pp2_on_two_ranks_matches_single_process_training",
                       "tests/engine/pipeline/test_pipeline_units.py::test_partition_context_and_set_partition_decide_the_stages"),
    "default_partition": ("tests/engine/pipeline/test_pipeline_units.py::test_partition_context_and_set_partition_decide_the_stages",),
    "memory_weight": ("tests/engine/pipeline/test_pipeline_units.py::test_memory_weight_moves_the_split_between_memory_and_compute",),
    "ddp": ("tests/engine/api/test_train_dist.py::test_training_equals_single_process_reference",),
    "ddp_port": ("tests/engine/api/test_engine_units.py::test_deepspeed_launcher_and_ddp_port_override",),
    "ddp_dist_backend": ("tests/engine/api/test_key_effects_dist.py::test_mapped_keys_reach_the_running_deepspeed_engine",),
    "shard_optimizer_state": ("tests/engine/api/test_key_effects_dist.py::test_mapped_keys_reach_the_running_deepspeed_engine",),
    "delayed_parameter_initialization": (
        "tests/engine/mics/test_mics_smp_api.py::test_smp_script_with_delayed_sharded_parameters_matches_single_process",
        "tests/scripts/test_model_creation_scripts.py::test_gpt2_sdp_script_with_delayed_init_and_adamw_matches_single_process",
        "tests/engine/tensor_parallel/test_tp_sdp_dist.py::test_tp2_sdp2_delayed_init_trains_like_single_process_and_holds_a_quarter",
        "tests/engine/api/test_finetune_from_hf_dist.py::test_delayed_initialisation_builds_on_meta_and_equals_the_eager_build"),
    "fp16": ("tests/engine/api/test_train_dist.py::test_fp16_overflow_skips_the_step_and_lowers_the_scale",),
    "fp16_params": ("tests/engine/api/test_key_effects_dist.py::test_deprecated_fp16_params_and_v2_hybrid_shard_degree_reach_the_engine",),
    "bf16": ("tests/engine/api/test_key_effects_dist.py::test_mapped_keys_reach_the_running_deepspeed_engine",
             "tests/engine/api/test_train_dist.py::test_bf16_trains_through_deepspeeds_bf16_block"),
    "sdp_reduce_bucket_size": ("tests/engine/api/test_key_effects_dist.py::test_mapped_keys_reach_the_running_deepspeed_engine",),
    "sdp_param_persistence_threshold": (
        "tests/engine/api/test_key_effects_dist.py::test_mapped_keys_reach_the_running_deepspeed_engine",),
    "sdp_max_live_parameters": ("tests/engine/api/test_key_effects_dist.py::test_mapped_keys_reach_the_running_deepspeed_engine",),
    "sdp_gradient_clipping": ("tests/engine/api/test_key_effects_dist.py::test_mapped_keys_reach_the_running_deepspeed_engine",
                              "tests/engine/mics/test_mics_smp_api.py::test_smp_script_with_delayed_sharded_parameters_matches_single_process"),
    "sdp_hierarchical_allgather": ("tests/engine/mics/test_mics_dist.py::test_hierarchical_allgather_gives_identical_results_on_two_nodes",),
    "optimize": ("tests/engine/nn/test_sequence_parallel_dist.py::test_memory_layout_saves_fewer_activations_per_layer",
                 "tests/engine/nn/test_sequence_parallel_dist.py::test_memory_layout_trains_like_single_process_hugging_face"),
    "offload_activations": ("tests/engine/core/test_activation_offload.py::test_offloading_frees_the_saved_device_tensors",
                            "tests/engine/core/test_activation_offload.py::test_horizon_comes_from_the_running_plan"),
    "activation_loading_horizon": (
        "tests/engine/core/test_activation_offload.py::test_prefetch_window_is_bounded_by_the_horizon_and_reached",
        "tests/engine/core/test_activation_offload.py::test_horizon_comes_from_the_running_plan"),
    "tensor_parallel_degree": (
        "tests/engine/tensor_parallel/test_tensor_parallel_dist.py::test_tp2_trains_hugging_face_families_and_an_smp_mlp_like_single_process",
        "tests/engine/tensor_parallel/test_tensor_parallel_dist.py::test_tp2_rdp2_and_tp4_on_four_ranks_match_single_process",
        "tests/engine/tensor_parallel/test_tp_pipeline_dist.py::test_pp2_tp2_trains_gpt2_bert_llama_and_an_smp_mlp_like_single_process"),
    "tensor_parallel_seed": (
        "tests/engine/tensor_parallel/test_tensor_parallel_dist.py::test_tp2_trains_hugging_face_families_and_an_smp_mlp_like_single_process",),
    "prescaled_batch": ("tests/engine/tensor_parallel/test_tensor_parallel_dist.py::test_tp2_rdp2_and_tp4_on_four_ranks_match_single_process",
                        "tests/engine/tensor_parallel/test_tp_sdp_dist.py::test_tp2_sdp2_delayed_init_trains_like_single_process_and_holds_a_quarter",
        "tests/engine/api/test_finetune_from_hf_dist.py::test_delayed_initialisation_builds_on_meta_and_equals_the_eager_build"),
    "hybrid_shard_degree": ("tests/engine/api/test_key_effects_dist.py::test_deprecated_fp16_params_and_v2_hybrid_shard_degree_reach_the_engine",),
}
"""key -> tests (``path`` or ``path::function``) that show its effect at run time."""


def _claimed() -> set[str]:
    return {key for table in (KEYMAP_V1, KEYMAP_V2) for key, rules in table.items()
            if any(rule.fate in ("mapped", "engine") for rule in rules)}


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_claimed_fate_names_runtime_evidence():
    missing = sorted(_claimed() - set(EVIDENCE))
    assert not missing, (f"keys reported as mapped/engine without a runtime test: {missing}; add the test to "
                         "EVIDENCE or change the key's fate in translator/keymap.py")


def test_evidence_is_only_given_for_claimed_keys():
    stale = sorted(set(EVIDENCE) - _claimed())
    assert not stale, f"EVIDENCE lists keys whose fate is no longer mapped/engine: {stale}"


@pytest.mark.parametrize("key", sorted(EVIDENCE))
def test_named_evidence_exists(key):
    for ref in EVIDENCE[key]:
        path, _, func = ref.partition("::")
        file = ROOT / path
        assert file.is_file(), f"{key}: {path} does not exist"
        if func:
            assert func in _functions(file), f"{key}: {path} has no test {func}"


def test_the_175b_seed_shows_tensor_8_by_pipeline_8_as_run_by_the_engine():
    """The seed's layout (tensor 8 x pipeline 8) is what the engine runs; the evidence is pp 2 x tp 2
    (tests/engine/tensor_parallel/test_tp_pipeline_dist.py), the same code path at a smaller degree."""
    import json

    from smp2ds.translator import normalize, plan
    from smp2ds.translator.plan_types import Layout

    spec = json.loads((ROOT / "examples/configs").joinpath(_seed_175b()).read_text())
    config = normalize(spec)
    result = plan(config, Layout())
    notes = {n.key: n for n in result.notes}
    assert notes["tensor_parallel_degree"].fate == "engine"
    assert notes["pipeline_parallel_degree"].fate == "engine"
    assert result.engine["tensor_parallel"]["degree"] == 8 and result.engine["tensor_parallel"]["unsupported"] is None
    assert result.deepspeed["pipeline"]["pipe_partitioned"] is False


def _seed_175b() -> str:
    names = [p.name for p in (ROOT / "examples/configs").glob("*175b*.json")]
    assert names, "the 175B seed scenario config is missing from examples/configs"
    return names[0]
