"""smp2ds's own settings that change how a run executes: environment variables, never SMP keys. Pure.

SMP's configuration is kept exactly as SageMaker accepted it (an unknown key there is an error), so a setting
SMP never had lives beside it, as ``SMP2DS_*`` environment variables like ``SMP2DS_LOG``. This module names
the ones that change the step itself, parses their values for the engine, and gives ``smp2ds explain`` one row
per variable that is set, marked as an smp2ds setting, not an SMP key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

COMPILE_ENV = "SMP2DS_COMPILE"
NOT_SMP = "smp2ds setting (not an SMP key)"


@dataclass(frozen=True, kw_only=True)
class Smp2dsSetting:
    """One environment variable: its allowed values and what the engine does with it."""

    name: str
    allowed: tuple[str, ...]
    effect: str


SETTINGS: tuple[Smp2dsSetting, ...] = (
    Smp2dsSetting(
        name=COMPILE_ENV, allowed=("0", "1"),
        effect=("1: before the first @smp.step the engine calls DeepSpeed's engine.compile() (torch.compile of the "
                "model with the accelerator's default backend); data-parallel layouts (DDP, ZeRO-1, sharded data "
                "parallelism, tensor parallelism), refused with pipeline parallelism; 0 or unset: eager"),
    ),
)


def _setting(name: str) -> Smp2dsSetting:
    return next(s for s in SETTINGS if s.name == name)


def setting_value(name: str, env: Mapping[str, str]) -> str | None:
    """The value of ``name`` in ``env`` (None when unset); ValueError naming the variable for any other value."""
    value = env.get(name)
    if value is None:
        return None
    allowed = _setting(name).allowed
    if value.strip() not in allowed:
        raise ValueError(f"environment variable {name}={value!r} is not one of {', '.join(allowed)}")
    return value.strip()


def compile_requested(env: Mapping[str, str]) -> bool:
    """``SMP2DS_COMPILE=1``: compile the model with DeepSpeed's ``engine.compile()``."""
    return setting_value(COMPILE_ENV, env) == "1"


def given_settings(env: Mapping[str, str]) -> list[dict[str, str]]:
    """One row (name, value, fate, effect) per smp2ds setting set in ``env``, for ``smp2ds explain``."""
    rows = []
    for setting in SETTINGS:
        if setting.name in env:
            rows.append({"name": setting.name, "value": env[setting.name], "fate": NOT_SMP,
                         "effect": setting.effect})
    return rows
