"""Activation checkpointing and offloading: SMP -> DeepSpeed ``activation_checkpointing``.

In SMP the script chooses the checkpointed modules (``smp.set_activation_checkpointing``) and the
config only says whether their saved inputs live on the CPU (``offload_activations``) and how
early they come back (``activation_loading_horizon``). DeepSpeed's ``cpu_checkpointing`` is the
same storage choice; it has no prefetch horizon, so that part stays with the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def activation_block(params: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSpeed ``activation_checkpointing`` (a plain dict: every key written out, no typos)."""
    return {
        "partition_activations": False,
        "contiguous_memory_optimization": False,
        "cpu_checkpointing": bool(params.get("offload_activations", False)),
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }


@dataclass(frozen=True, kw_only=True)
class ActivationSettings:
    """What the engine does itself (the Plan's ``/engine/activation_checkpointing``); the defaults
    here are the only ones: the modules come from the script, the horizon from the config."""

    offload: bool = False
    """SMP's ``offload_activations``: checkpointed inputs wait in CPU memory until backward."""
    loading_horizon: int = 4
    """SMP's ``activation_loading_horizon``: how many activations ahead backward fetches back."""
    modules: str = "chosen in the script with smp.set_activation_checkpointing"


def engine_activation(params: Mapping[str, Any]) -> ActivationSettings:
    """The engine's activation settings for the resolved SMP parameters."""
    return ActivationSettings(
        offload=bool(params.get("offload_activations", ActivationSettings.offload)),
        loading_horizon=params.get("activation_loading_horizon", ActivationSettings.loading_horizon),
    )
