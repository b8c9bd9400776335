"""Property tests (hypothesis) over dicts generated from the schema itself.

* Schema-valid SMP v1 dicts, bare or wrapped in a distribution / estimator spec, never crash
  normalize: it returns a complete SMPConfig or raises SMPConfigError whose issues all point at a
  key of the document (or the place a missing key belongs); validate reports the same issues.
* A valid dict with one mutation (unknown key, wrong type, out-of-range or non-enum value) always
  yields at least one Issue naming the mutated key's pointer, in every document shape.
"""

from __future__ import annotations

import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from smp2ds.schemas import load_schema
from smp2ds.translator.document import escape
from smp2ds.translator.issues import SMPConfigError
from smp2ds.translator.normalize import normalize
from smp2ds.translator.plan_types import Layout, SMPConfig
from smp2ds.translator.validate import validate

PROPS = dict(load_schema("smp_v1")["properties"])
CANONICAL = set(PROPS) - {"partitions"}
PARAMS = ("distribution", "smdistributed", "modelparallel", "parameters")
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _types(spec):
    types = spec["type"]
    return [types] if isinstance(types, str) else types


def value_strategy(spec):
    """Schema-valid values for one property (small integers keep the cross-key rules busy)."""
    options = []
    for kind in _types(spec):
        if kind == "null":
            options.append(st.none())
        elif "enum" in spec:
            options.append(st.sampled_from(spec["enum"]))
        elif kind == "integer":
            low = spec.get("minimum", 0)
            options.append(st.integers(min_value=low, max_value=spec.get("maximum", low + 9)))
        elif kind == "number":
            options.append(
                st.floats(
                    min_value=spec.get("minimum", 0.0), max_value=spec.get("maximum", 10.0), allow_nan=False
                )
            )
        elif kind == "boolean":
            options.append(st.booleans())
        elif kind == "string":
            options.append(st.text(string.ascii_letters + "./_", max_size=12))
    return st.one_of(*options)


valid_params = st.fixed_dictionaries({}, optional={k: value_strategy(v) for k, v in PROPS.items()})


def wrap(params, shape):
    """Put a parameter dict into one of the document shapes; returns (doc, path of the params)."""
    dist = {
        "smdistributed": {"modelparallel": {"enabled": True, "parameters": params}},
        "mpi": {"enabled": True},
    }
    if shape == "parameters":
        return params, ()
    if shape == "distribution":
        return dist, PARAMS[1:]
    return {"instance_type": "ml.p4d.24xlarge", "instance_count": 1, "distribution": dist}, PARAMS


def pointer(path):
    return "".join("/" + escape(p) for p in path)


shapes = st.sampled_from(["parameters", "distribution", "estimator"])
layouts = st.one_of(
    st.none(),
    st.builds(
        Layout,
        world_size=st.sampled_from([1, 2, 4, 8, 12]),
        batch_size=st.one_of(st.none(), st.integers(1, 16)),
    ),
)


@SETTINGS
@given(params=valid_params, shape=shapes, layout=layouts)
def test_schema_valid_dicts_normalize_or_fail_cleanly(params, shape, layout):
    doc, path = wrap(params, shape)
    try:
        config = normalize(doc, layout)
    except SMPConfigError as err:
        issues = err.issues
        assert issues
        prefix = pointer(path)
        for issue in issues:
            # Every issue names a parameter of the document (given or where it would go),
            # the mpi block or the root; never a schema error, since the values are valid.
            assert issue.pointer == "" or issue.pointer.startswith(prefix + "/") or "/mpi" in issue.pointer
            key = issue.pointer[len(prefix) + 1 :]
            if issue.pointer.startswith(prefix + "/"):
                assert key in PROPS, issue
                assert not issue.message.startswith(("must be an", "must be a ", "unknown")), issue
        assert [(i.pointer, i.message) for i in validate(doc, layout)] == [
            (i.pointer, i.message) for i in issues
        ]
        return
    assert isinstance(config, SMPConfig)
    assert set(config.params) == CANONICAL
    assert 1 <= config.active_microbatches <= config.microbatches
    if config.active_microbatches != config.microbatches:
        assert config.pipeline == "interleaved"
    assert validate(doc, layout) == []


def _wrong_values(spec):
    """Values of the wrong type or outside the allowed set for one property."""
    types = set(_types(spec))
    wrong = []
    if "integer" in types:
        wrong += [
            st.floats(allow_nan=False, allow_infinity=False),
            st.integers(0, 99).map(str),
            st.booleans(),
        ]
        if "minimum" in spec:
            wrong.append(st.integers(max_value=spec["minimum"] - 1))
    if "number" in types:
        wrong += [st.integers(-5, 5), st.text(max_size=3)]
        if "maximum" in spec:
            wrong.append(st.floats(min_value=spec["maximum"] + 0.5, max_value=1e6))
    if "boolean" in types:
        wrong += [st.integers(0, 1), st.sampled_from(["true", "false", "yes"]), st.none()]
    if "enum" in spec:
        wrong.append(st.text(min_size=1, max_size=8).filter(lambda s: s not in spec["enum"]))
    if "string" in types and "enum" not in spec:
        wrong += [st.integers(), st.booleans(), st.lists(st.integers(), max_size=2)]
    return st.one_of(*wrong)


@st.composite
def mutated(draw):
    params = draw(valid_params)
    shape = draw(shapes)
    how = draw(st.sampled_from(["unknown_key", "bad_value"]))
    if how == "unknown_key":
        key = draw(
            st.text(string.ascii_letters + "_~/", min_size=1, max_size=15).filter(
                lambda k: k not in PROPS and k != "$schema"
            )
        )
        params[key] = draw(st.integers())
    else:
        key = draw(st.sampled_from(sorted(PROPS)))
        params[key] = draw(_wrong_values(PROPS[key]))
    doc, path = wrap(params, shape)
    return doc, pointer(path + (key,))


@SETTINGS
@given(case=mutated())
def test_mutated_dicts_always_name_the_pointer(case):
    doc, where = case
    issues = validate(doc)
    assert any(issue.pointer == where for issue in issues), (where, [str(i) for i in issues])
    with pytest.raises(SMPConfigError):
        normalize(doc)


@SETTINGS
@given(
    count=st.one_of(st.integers(max_value=0), st.floats(allow_nan=False), st.text(max_size=3), st.booleans()),
    itype=st.text(max_size=10).filter(lambda s: not s.startswith("ml.")),
)
def test_mutated_estimator_fields_name_their_pointer(count, itype):
    doc, _ = wrap({"ddp": True}, "estimator")
    doc.update(instance_count=count, instance_type=itype)
    pointers = {issue.pointer for issue in validate(doc)}
    assert {"/instance_count", "/instance_type"} <= pointers


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
slots = st.sampled_from(
    [
        ("distribution",),
        ("distribution", "smdistributed"),
        ("distribution", "smdistributed", "modelparallel"),
        ("distribution", "smdistributed", "modelparallel", "parameters"),
        ("distribution", "smdistributed", "modelparallel", "enabled"),
        ("distribution", "mpi"),
        ("distribution", "mpi", "processes_per_host"),
        ("distribution", "torch_distributed"),
        ("hyperparameters",),
        ("instance_count",),
        ("instance_type",),
    ]
)


@SETTINGS
@given(slot=slots, value=json_values, layout=layouts)
def test_any_json_anywhere_gives_issues_not_crashes(slot, value, layout):
    doc, _ = wrap({"partitions": 2, "ddp": True}, "estimator")
    node = doc
    for key in slot[:-1]:
        node = node[key]
    node[slot[-1]] = value
    issues = validate(doc, layout)
    assert all(i.pointer == "" or i.pointer.startswith("/") for i in issues)
    try:
        normalize(doc, layout)
    except SMPConfigError as err:
        assert err.issues


@SETTINGS
@given(doc=json_values)
def test_any_json_document_gives_issues_not_crashes(doc):
    issues = validate(doc)
    assert isinstance(issues, list)
    if not isinstance(doc, dict):
        assert [i.pointer for i in issues] == [""]
