"""The optimizer state under Hugging Face names, planned without reading a moment and translated a unit at a time.

A made-up family translator fuses ``a`` and ``b`` of each layer into one ``ab`` (as GPT-NeoX fuses q, k, v) and
renames the rest; the state comes from memory (:func:`optimizer_state.whole_source`), so the checks are about the
translation: shapes planned from meta tensors, moments translated like their weights, one group per parameter.
"""

from __future__ import annotations

import pytest
import torch

from smp2ds.engine.checkpoint_tools import hf_naming
from smp2ds.engine.checkpoint_tools.optimizer_state import whole_source
from smp2ds.engine.exceptions import SMPUnsupportedError

KEYS = ["m.seq_layers.0.a", "m.seq_layers.0.b", "m.seq_layers.1.a", "m.seq_layers.1.b", "m.embedding"]


def fuse(tensors: dict) -> dict:
    out = {}
    for layer in ("0", "1"):
        if f"m.seq_layers.{layer}.a" in tensors:
            out[f"h.{layer}.ab"] = torch.cat([tensors[f"m.seq_layers.{layer}.a"], tensors[f"m.seq_layers.{layer}.b"]])
    if "m.embedding" in tensors:
        out["wte"] = tensors["m.embedding"]
        out["lm_head"] = tensors["m.embedding"]  # tied: a second name of one tensor
    return out


def optimizer(groups: list[list[str]]) -> dict:
    gen = torch.Generator().manual_seed(0)
    state = {k: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3, generator=gen),
                 "exp_avg_sq": torch.rand(2, 3, generator=gen)} for k in KEYS}
    return {"state": state, "param_groups": [{"lr": 0.1, "weight_decay": wd, "params": names}
                                             for wd, names in zip((0.01, 0.0), groups)]}


def renaming() -> hf_naming.Renaming:
    return hf_naming.plan({k: ((2, 3), torch.float32) for k in KEYS}, fuse)


def test_state_is_planned_and_translated_unit_by_unit_like_the_weights():
    optim = optimizer([KEYS[:4], KEYS[4:]])  # the layers decay, the embedding does not
    source, names = whole_source(optim), renaming()
    planned = hf_naming.plan_state(names, source)
    assert sorted(planned.state) == ["h.0.ab", "h.1.ab", "wte"]  # the tied head has no state of its own
    assert planned.state["h.1.ab"]["exp_avg"].is_meta and planned.state["h.1.ab"]["exp_avg"].shape == (4, 3)
    assert float(planned.state["wte"]["step"]) == 3.0
    assert [g["params"] for g in planned.param_groups] == [["h.0.ab", "h.1.ab"], ["wte"]]
    assert [g["weight_decay"] for g in planned.param_groups] == [0.01, 0.0]
    assert planned.unit_of == {"h.0.ab": 0, "h.1.ab": 1, "wte": 2}
    moments = hf_naming.unit_moments(names, 1, source, "exp_avg_sq")
    assert list(moments) == ["h.1.ab"]
    torch.testing.assert_close(moments["h.1.ab"], torch.cat([optim["state"]["m.seq_layers.1.a"]["exp_avg_sq"],
                                                            optim["state"]["m.seq_layers.1.b"]["exp_avg_sq"]]))
    assert list(hf_naming.unit_moments(names, 2, source, "exp_avg")) == ["wte"]


def test_a_parameter_joined_from_two_groups_is_refused_by_name_before_anything_is_read():
    optim = optimizer([["m.seq_layers.0.a", *KEYS[2:]], ["m.seq_layers.0.b"]])
    with pytest.raises(SMPUnsupportedError, match=r"h\.0\.ab joins parameters of optimizer parameter groups \[0, 1\]"):
        hf_naming.plan_state(renaming(), whole_source(optim))
