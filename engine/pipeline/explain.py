"""The pipeline split for a Hugging Face model config, without weights (for ``smp2ds explain``).

The model is built on PyTorch's meta device from its config (``architectures[0]`` names the
class), so even a 175B configuration costs no memory; its layer list and SMP's cost model then
give the split ``DistributedModel`` would choose at run time. Manual placement
(``smp.partition`` in the user's script) cannot be seen from a config: with
``auto_partition: false`` every layer is reported on ``default_partition``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from smp2ds.engine.pipeline.layers import SUPPORTED, UnsupportedModelError, build_layer_list
from smp2ds.engine.pipeline.partition_plan import PartitionPlan, plan_partition


@dataclass(frozen=True)
class ModelSplit:
    """The split of one model and what it was computed from."""

    architecture: str
    n_params: int
    plan: PartitionPlan


def split_for_model_config(model_config: Mapping[str, Any], smp_params: Mapping[str, Any]) -> ModelSplit:
    """Build ``model_config``'s model on the meta device and split it by ``smp_params``' rules.

    Raises ValueError naming the supported architectures when the config's class has no
    pipeline layer list (a ``*ForCausalLM`` is cut by its decoder structure, or refused with the reason).
    """
    import torch
    import transformers

    archs = list(model_config.get("architectures") or [])
    if not archs or "model_type" not in model_config:
        raise ValueError("the model config needs \"model_type\" and \"architectures\" (as in a Hugging Face "
                         f"config.json); supported architectures: {', '.join(SUPPORTED)}")
    arch = archs[0]
    cls = getattr(transformers, arch, None)
    # Other *ForCausalLM classes are cut by their decoder structure (families/hf_decoder).
    if cls is None or (f"transformers {arch}" not in SUPPORTED and not arch.endswith("ForCausalLM")):
        raise ValueError(f"architecture {arch!r} has no pipeline layer list; supported: {', '.join(SUPPORTED)} "
                         "(or nn.Sequential / smp.partition in the script)")
    fields = {k: v for k, v in model_config.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(model_config["model_type"], **fields)
    with torch.device("meta"):
        model = cls(config)
    stages = int(smp_params.get("pipeline_parallel_degree", 1))
    auto = bool(smp_params.get("auto_partition", True))
    try:
        layer_list = build_layer_list(model)
    except UnsupportedModelError as exc:
        raise ValueError(f"architecture {arch!r} has no pipeline layer list: {exc}") from None
    plan = plan_partition(layer_list, stages, auto=auto,
                          memory_weight=float(smp_params.get("memory_weight", 0.8)),
                          default_partition=smp_params.get("default_partition") or 0)
    n_params = sum(p.numel() for p in model.parameters())
    return ModelSplit(architecture=arch, n_params=n_params, plan=plan)
