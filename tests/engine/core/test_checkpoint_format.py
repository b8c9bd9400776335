"""One home for the checkpoint file format: ``engine/core/checkpoint_format.py`` spells every name; the writer
(``api/checkpoint.py``), the reader (``checkpoint_tools/checkpoint_folder.py``) and the resharder (``reshard.py``) build
and parse names only through it, so a name changed there changes for all three."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from smp2ds.engine.core import checkpoint_format as fmt

ENGINE = Path(__file__).resolve().parents[3] / "engine"
SPELLINGS = ("_partial", "user_content.pt", "user_content_", "smp_config.pt", "optimizer_states",
             "_smp_is_partial", "_smp_load_info", "_smp_zero2d", "smp2ds_manifest", "pytorch_model.bin_", "optimizer.pt_")
"""Fragments of the format's names as string constants (an f-string's literal parts included): a module that holds
one spells the format itself. ("newest" is also a plain word in reports, so it is not searched.)"""
EXACT = ("model_",)
"""Whole constants that spell a name: the literal head of ``f"model_{pp}_{tp}.pt"``."""


@pytest.mark.parametrize("trainer", [False, True])
def test_every_part_name_parses_back_to_its_ranks(trainer):
    for pp, tp in ((0, 0), (3, 1), (12, 7)):
        assert fmt.match(fmt.model_file(pp, tp, trainer=trainer), fmt.MODEL_PATTERNS) == (pp, tp)
        assert fmt.match(fmt.optimizer_file(pp, tp, trainer=trainer), fmt.OPTIMIZER_PATTERNS) == (pp, tp, None)
        assert fmt.match(fmt.optimizer_file(pp, tp, 5, trainer=trainer), fmt.OPTIMIZER_PATTERNS) == (pp, tp, 5)
    assert fmt.model_file(1, 2) == "model_1_2.pt" and fmt.optimizer_file(1, 2, 3) == "optimizer_states_1_2_3.pt"
    assert fmt.match("pytorch_model.bin_1_0.pt", fmt.MODEL_PATTERNS) == (1, 0)  # smp.save may add .pt
    assert fmt.match("model_1_2.bin", fmt.MODEL_PATTERNS) is None
    assert fmt.match(fmt.USER_CONTENT, fmt.MODEL_PATTERNS + fmt.OPTIMIZER_PATTERNS) is None


def test_partial_entries_and_tags_are_inverse():
    assert fmt.partial_entry("step_10") == "step_10_partial" == fmt.partial_entry("step_10_partial")
    assert fmt.tag_of(fmt.partial_entry("step_10")) == "step_10" and fmt.tag_of("step_10") is None
    assert fmt.full_user_content("fullmodel.pt") == "user_content_fullmodel.pt"


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module but its docstrings (f-string parts included)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_engine_module_but_the_format_spells_a_checkpoint_name():
    spelled = []
    for path in sorted(ENGINE.rglob("*.py")):
        if path.name == "checkpoint_format.py":
            continue
        for line, text in _string_constants(path):
            # messages may name a file for the user ("model_<pp>_<tp>.pt or ..."): only code-like fragments count
            code_like = " " not in text.strip()
            if code_like and (text in EXACT or any(fragment in text for fragment in SPELLINGS)):
                spelled.append(f"{path.relative_to(ENGINE)}:{line}: {text!r}")
    assert not spelled, "checkpoint names spelled outside engine/core/checkpoint_format.py:\n" + "\n".join(spelled)
