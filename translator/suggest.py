"""Fix hints for unknown keys: "did you mean ...?" and "`k` belongs under `mpi`".

Every key smp2ds knows has one home in an estimator spec; a key found anywhere else is either
misplaced (hint names its home) or a typo (hint names the closest allowed spellings).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from functools import lru_cache

from smp2ds.schemas import load_schema

# Homes as paths from the estimator root. SMP parameter keys live in the modelparallel parameters.
_PARAMS_HOME: tuple[str, ...] = ("distribution", "smdistributed", "modelparallel", "parameters")
_FIXED_HOMES: dict[str, tuple[str, ...]] = {
    "processes_per_host": ("distribution", "mpi"),
    "custom_mpi_options": ("distribution", "mpi"),
    "parameters": ("distribution", "smdistributed", "modelparallel"),
    "modelparallel": ("distribution", "smdistributed"),
    "dataparallel": ("distribution", "smdistributed"),
    "smdistributed": ("distribution",),
    "mpi": ("distribution",),
    "torch_distributed": ("distribution",),
    "pytorchddp": ("distribution",),
}


@lru_cache(maxsize=1)
def _homes() -> dict[str, tuple[str, ...]]:
    homes: dict[str, tuple[str, ...]] = {}
    for name in load_schema("estimator")["properties"]:
        homes[name] = ()
    for name in list(load_schema("smp_v1")["properties"]) + list(load_schema("smp_v2")["properties"]):
        homes[name] = _PARAMS_HOME
    homes.update(_FIXED_HOMES)
    return homes


def _relative_home(home: tuple[str, ...], root_kind: str) -> str:
    """Render a home path as the user would see it from their document's root."""
    if root_kind == "estimator":
        return ".".join(home) if home else "the top level of the estimator spec"
    if root_kind == "distribution":
        if home[:1] == ("distribution",):
            return ".".join(home[1:]) if len(home) > 1 else "the top level of the distribution"
        return "the estimator spec (top level), not the distribution"
    # A bare parameter dict: everything else lives in the estimator around it.
    if home == _PARAMS_HOME:
        return "the SMP parameters"
    if home[:1] == ("distribution",):
        return f"the estimator's `{'.'.join(home)}`, not the SMP parameters"
    return "the estimator spec (top level), not the SMP parameters"


def _normal(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def close_matches(key: str, allowed: Iterable[str], n: int = 3) -> list[str]:
    """Allowed keys closest to ``key`` (case, dash/underscore and small typos forgiven)."""
    allowed = list(allowed)
    by_normal = {_normal(a): a for a in allowed}
    if _normal(key) in by_normal:
        return [by_normal[_normal(key)]]
    wanted = _normal(key)
    found = difflib.get_close_matches(wanted, list(by_normal), n=n, cutoff=0.6)
    if not found:
        return []
    # Offer runners-up only when they are about as close as the best match.
    best = difflib.SequenceMatcher(None, wanted, found[0]).ratio()
    return [by_normal[f] for f in found if difflib.SequenceMatcher(None, wanted, f).ratio() >= best - 0.05]


def unknown_key_hint(key: str, allowed: Iterable[str], here: tuple[str, ...], root_kind: str) -> str | None:
    """A hint for ``key`` found where it is not allowed.

    ``here`` is the path (from the estimator root) of the object holding the key, ``allowed``
    the keys accepted there and ``root_kind`` what the user's document is (estimator,
    distribution, parameters, smp_v2), which decides how a home is spelled.
    """
    homes = _homes()
    if key in homes and homes[key] != here:
        return f"`{key}` belongs under {_quote(_relative_home(homes[key], root_kind))}"
    local = close_matches(key, allowed)
    if local:
        return "did you mean " + " or ".join(f"`{m}`" for m in local) + "?"
    elsewhere = close_matches(key, homes, n=1)
    if elsewhere and homes[elsewhere[0]] != here:
        where = _relative_home(homes[elsewhere[0]], root_kind)
        return f"did you mean `{elsewhere[0]}`? it belongs under {_quote(where)}"
    return None


def _quote(where: str) -> str:
    # Paths are quoted like keys; prose ("the SMP parameters") is left as is.
    return f"`{where}`" if " " not in where else where
