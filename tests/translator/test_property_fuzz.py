"""Property tests through the command line, over SMP dicts generated from our own JSON schema.

``hypothesis-jsonschema`` turns ``smp_v1.schema.json`` into a strategy, so every key, type,
enum and bound the schema allows is exercised without a hand-written generator. For each
schema-valid dict and world size:

* ``smp2ds convert`` never crashes: exit 0 with a DeepSpeed config that DeepSpeed's own config
  classes accept, or exit 1 (a cross-key rule) where every problem carries a JSON pointer;
* ``smp2ds explain --format json`` gives every key of the dict a fate;
* one mutation (unknown key, wrong type, out-of-range or non-enum value) is exit 1 from
  ``smp2ds validate`` with the mutated key's pointer in the report.

Examples are bounded (``max_examples``) so the module runs in well under a minute.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")
pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from smp2ds.cli import main  # noqa: E402
from smp2ds.schemas import load_schema  # noqa: E402
from smp2ds.translator.document import escape  # noqa: E402

SCHEMA = load_schema("smp_v1")
PROPS = dict(SCHEMA["properties"])
VALID_DICTS = hypothesis_jsonschema.from_schema(SCHEMA)
WORLDS = st.sampled_from([1, 2, 4, 8, 16])
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.filter_too_much])


def _cli(argv: list[str], doc: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    path = tmp_path / "params.json"
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    code = main([*argv[:1], str(path), *argv[1:]])
    out, err = capsys.readouterr()
    return code, out, err


def _pointers(report: str) -> list[str]:
    """The pointer of every problem line (``  /key: message``) of a text report."""
    return [line.strip().split(":", 1)[0] for line in report.splitlines() if line.startswith("  /")]


def _accepted_by_deepspeed(ds: dict[str, Any]) -> None:
    DeepSpeedZeroConfig(**ds["zero_optimization"])
    DeepSpeedFP16Config(**ds["fp16"])
    DeepSpeedBF16Config(**ds["bf16"])
    one = copy.deepcopy(ds)  # DeepSpeedConfig without a process group checks world size 1
    one.pop("train_batch_size", None)
    one.setdefault("train_micro_batch_size_per_gpu", 1)
    DeepSpeedConfig(one)


@SETTINGS
@given(doc=VALID_DICTS, world=WORLDS)
def test_convert_never_crashes_and_deepspeed_accepts_what_it_emits(tmp_path, capsys, doc, world):
    code, out, err = _cli(["convert", "--world-size", str(world)], doc, tmp_path, capsys)
    event(f"convert exit {code}")  # --hypothesis-show-statistics: both outcomes must occur
    assert code in (0, 1), (doc, world, code, err)
    assert "Traceback" not in err and "internal error" not in err, err
    if code == 0:
        _accepted_by_deepspeed(json.loads(out))
    else:
        problems = _pointers(err)
        assert problems and all(p.startswith("/") for p in problems), (doc, world, err)
        assert "invalid SMP configuration" in err


@SETTINGS
@given(doc=VALID_DICTS, world=WORLDS)
def test_explain_gives_every_key_a_fate(tmp_path, capsys, doc, world):
    code, out, err = _cli(["explain", "--world-size", str(world), "--format", "json"], doc, tmp_path, capsys)
    assert code in (0, 1), (doc, world, code, err)
    if code == 0:
        fates = {k["pointer"]: k["fate"] for k in json.loads(out)["keys"]}
        missing = [k for k in doc if f"/{escape(k)}" not in fates]
        assert not missing, (doc, missing, fates)
        assert set(fates.values()) <= {"mapped", "engine", "ignored", "unsupported"}


def test_explain_lists_the_schema_key(tmp_path, capsys):
    code, out, _ = _cli(["explain", "--format", "json", "--world-size", "2"], {"$schema": "x", "ddp": True}, tmp_path, capsys)
    assert code == 0
    notes = {k["pointer"]: k for k in json.loads(out)["keys"]}
    assert notes["/$schema"]["fate"] == "ignored" and "editors" in notes["/$schema"]["reason"]


def _wrong_type_value(spec: dict[str, Any]) -> Any:
    types = spec.get("type", [])
    types = [types] if isinstance(types, str) else types
    if "string" not in types and "enum" not in spec:
        return "not-a-value"
    return {"nested": ["object"]} if "object" not in types else 12345


@st.composite
def mutated(draw: Any) -> tuple[dict[str, Any], str]:
    """A schema-valid dict with one mistake, and the pointer the report must name."""
    doc = dict(draw(VALID_DICTS))
    how = draw(st.sampled_from(["unknown", "type", "range_or_enum"]))
    if how == "unknown":
        key = draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12)
                   .filter(lambda k: k not in PROPS))
        doc[key] = draw(st.integers(0, 9))
        return doc, f"/{key}"
    key = draw(st.sampled_from(sorted(PROPS)))
    spec = PROPS[key]
    if how == "type":
        doc[key] = _wrong_type_value(spec)
    elif "enum" in spec:
        doc[key] = "no-such-choice"
    elif "minimum" in spec:
        doc[key] = spec["minimum"] - 1
    else:
        doc[key] = _wrong_type_value(spec)
    return doc, f"/{escape(key)}"


@SETTINGS
@given(case=mutated())
def test_one_mutation_is_exit_1_with_its_pointer(tmp_path, capsys, case):
    doc, pointer = case
    code, out, err = _cli(["validate"], doc, tmp_path, capsys)
    assert code == 1, (doc, out, err)
    assert pointer in _pointers(out), (doc, pointer, out)
