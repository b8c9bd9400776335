"""``smp2ds.engine.core.module_creation``: one wrapper of ``nn.Module.__init__`` serves the pipeline's partition
tags and tensor parallelism's marks, only while a context is open."""

from __future__ import annotations

from torch import nn

from smp2ds.engine.core.module_creation import CreationTag


def test_two_kinds_of_tag_nest_close_in_any_order_and_restore_init():
    plain_init = nn.Module.__init__
    stages: dict[int, int] = {}
    marks: dict[int, str] = {}
    stage = CreationTag(lambda m, v: stages.setdefault(id(m), v))
    mark = CreationTag(lambda m, v: marks.__setitem__(id(m), v))
    outer = stage.around(1)
    outer.__enter__()
    first = nn.Linear(2, 2)
    inner = mark.around("tp")
    inner.__enter__()
    with stage.around(2):
        second = nn.ReLU()  # parameterless modules are tagged too
    outer.__exit__(None, None, None)  # the stage context closes before the mark's
    third = nn.Linear(2, 2)
    inner.__exit__(None, None, None)
    fourth = nn.Linear(2, 2)
    assert nn.Module.__init__ is plain_init  # nothing wraps construction outside the contexts
    assert stages == {id(first): 1, id(second): 2}
    assert marks == {id(second): "tp", id(third): "tp"} and id(fourth) not in marks
    assert stage.current is None and mark.current is None
