"""A partial SMP checkpoint -> a ``torch.distributed.checkpoint`` (DCP) directory.

The directory holds one state dict, keyed as ``torch.distributed.checkpoint.state_dict`` names
things, so a job of any world size (FSDP2, DDP, one process) loads it with DCP's own loader::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=DIR)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

* ``model``: the full state dict under the model's own names (:mod:`.consolidate`), as
  ``model.state_dict()`` has it; a distributed-transformer checkpoint's under Hugging Face's names by default
  (:mod:`.hf_naming`: the Hugging Face model loads it), or SMP's with ``--names smp``;
* ``optim``: the optimizer state by parameter name (:mod:`.optimizer_state`), the layout
  ``get_optimizer_state_dict`` gives: ``{"state": {name: {"step", "exp_avg", "exp_avg_sq"}},
  "param_groups": [{lr, betas, ..., "params": [names]}]}``. ``step`` is a float32 0-d tensor, as
  ``torch.optim.Adam`` keeps it. Absent when the checkpoint holds no optimizer state.

Streaming: DCP plans from the tensors' shapes and dtypes (meta tensors stand in for the model's
weights) and asks for each tensor's bytes only when it writes it (:class:`_LazyPlanner`), one at a
time (one writer thread), and each tensor goes to a file of its own: torch's ``FileSystemWriter`` keeps
every tensor of a file referenced until the file is closed, so one file for the rank would hold the whole
model at the end. The optimizer's moments are asked for the same way, one parameter's moment at a time
(:class:`.optimizer_state.StateSource`; with Hugging Face names, one layer's moments at a time). The directory is
written under a temporary name and renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from smp2ds.engine.checkpoint_tools import consolidate, hf_naming, optimizer_state
from smp2ds.engine.checkpoint_tools.checkpoint_folder import CheckpointLayout
from smp2ds.engine.exceptions import SMPInvalidArgumentError

MODEL_KEY, OPTIM_KEY = "model", "optim"


def _planner(lazy: dict[str, Callable[[], torch.Tensor]], order: dict[str, tuple[int, ...]] | None = None) -> Any:
    """A DCP save planner that makes the tensors of ``lazy`` (flattened key -> producer) on demand, writing them in
    the order ``order`` gives (flattened key -> sort key; others first, as DCP planned them)."""
    import dataclasses

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _LazyPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            make = lazy.get(write_item.index.fqn)
            return make() if make is not None else super().resolve_data(write_item)

        def finish_plan(self, new_plan: Any) -> Any:
            plan = super().finish_plan(new_plan)
            if not order:
                return plan
            # stable: DCP's own order within a sort key; the metadata names each item's file, not its position
            items = sorted(plan.items, key=lambda item: order.get(item.index.fqn, ()))
            return dataclasses.replace(plan, items=items)

    return _LazyPlanner()


def check_out_dir(out_dir: str, flag: str) -> None:
    """Refuse an ``out_dir`` that exists and is not empty (an export never overwrites)."""
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise SMPInvalidArgumentError(f"{flag} {out_dir}: exists and is not an empty folder; choose another "
                                      "output folder (export never overwrites)")


@contextlib.contextmanager
def staged_output(out_dir: str) -> Iterator[str]:
    """A staging folder beside ``out_dir`` to write into; renamed to ``out_dir`` when the block ends, removed
    when it raises, so an export is whole or absent (``out_dir``: empty or missing, see `check_out_dir`)."""
    staging = f"{out_dir.rstrip(os.sep)}.smp2ds-partial"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        yield staging
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked before the export began)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def optimizer_dict(state: dict[str, dict[str, Any]], param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The optimizer state as ``get_optimizer_state_dict`` lays it out (``step`` a float32 0-d tensor)."""
    out = {}
    for name, values in state.items():
        entry = dict(values)
        if "step" in entry:
            entry["step"] = torch.tensor(float(entry["step"]), dtype=torch.float32)
        out[name] = entry
    return {"state": out, "param_groups": [{**g, "params": list(g["params"])} for g in param_groups]}


def export(layout: CheckpointLayout, out_dir: str, translate: hf_naming.Translate | None = None) -> list[str]:
    """Write the DCP directory ``out_dir``; returns the top-level keys written (``model``, ``optim``).

    ``translate``: the family's SMP -> Hugging Face translator; the model and optimizer state are then written
    under Hugging Face's names (:mod:`.hf_naming`), a layer at a time.
    """
    import torch.distributed.checkpoint as dcp

    check_out_dir(out_dir, "--to dcp")
    reader = consolidate.ShardReader()
    entries = consolidate.checked_plan(layout, reader)
    source = optimizer_state.state_source(layout, entries, reader) if layout.optimizer_files else None
    order: dict[str, tuple[int, ...]] = {}
    if translate is not None:
        model, lazy, optim = _translated(entries, reader, source, translate, order)
    else:
        model = {e.key: hf_naming.meta_tensor(e.shape, e.dtype) for e in entries}
        lazy = {f"{MODEL_KEY}.{e.key}": _producer(e, reader) for e in entries}
        optim = _untranslated_optimizer(source, lazy) if source is not None else None
    state: dict[str, Any] = {MODEL_KEY: model}
    if optim is not None:
        state[OPTIM_KEY] = optim
    with staged_output(out_dir) as staging:
        # a file per tensor: the writer lets go of a tensor when its file closes (module docstring)
        writer = dcp.FileSystemWriter(staging, single_file_per_rank=False, thread_count=1)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.save(state, storage_writer=writer, planner=_planner(lazy, order), no_dist=True)
    return list(state)


def _producer(entry: consolidate.Entry, reader: consolidate.ShardReader) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        reader.maybe_release()  # the previous tensor is written and dropped by now
        return consolidate.join(entry, reader)
    return make


def _moment_fqn(name: str, moment: str) -> str:
    """DCP's flattened key of one moment (its nested keys joined by dots)."""
    return f"{OPTIM_KEY}.state.{name}.{moment}"


def _untranslated_optimizer(source: optimizer_state.StateSource, lazy: dict[str, Callable[[], torch.Tensor]],
                            ) -> dict[str, Any]:
    """The optimizer state dict with meta moments, each registered in ``lazy`` to be read when written."""
    def producer(name: str, moment: str) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            source.release()  # the previous moment is written and dropped by now
            return source.tensor(name, moment)
        return make

    state = {}
    for name, scalars in source.scalars.items():
        state[name] = {**scalars, **{m: hf_naming.meta_tensor(*spec) for m, spec in source.moments[name].items()}}
        lazy.update({_moment_fqn(name, m): producer(name, m) for m in source.moments[name]})
    return optimizer_dict(state, source.param_groups)


def _translated(entries: list[consolidate.Entry], reader: consolidate.ShardReader,
                source: optimizer_state.StateSource | None, translate: hf_naming.Translate,
                order: dict[str, tuple[int, ...]]) -> tuple[dict, dict, dict[str, Any] | None]:
    """(meta model state, lazy producers, optimizer state with meta moments), all under Hugging Face's names. A
    producer translates its unit when first asked and keeps that unit's tensors not yet written until another unit
    is asked for: a unit's weights, or one moment of a unit's parameters. DCP would write a parameter's moments one
    after the other, so ``order`` is filled to have it write a unit's ``exp_avg`` of every parameter, then its
    ``exp_avg_sq``: one moment of one unit is held at a time."""
    by_key = {e.key: e for e in entries}
    renaming = hf_naming.plan({e.key: (e.shape, e.dtype) for e in entries}, translate)
    model = {key: hf_naming.meta_tensor(shape, dtype) for key, shape, dtype, _ in renaming.outputs}
    held: dict[str, Any] = {"unit": None, "tensors": {}}

    def make_unit(unit: tuple[str, int, str]) -> dict[str, torch.Tensor]:
        kind, index, moment = unit
        # a unit's pieces are read once: their pages go as soon as it is made (what the output maps stays mapped)
        if kind == MODEL_KEY:
            made = renaming.translate_unit(index, {k: consolidate.join(by_key[k], reader)
                                                   for k in renaming.units[index]})
            reader.maybe_release(force=True)
            return made
        assert source is not None
        made = dict(hf_naming.unit_moments(renaming, index, source, moment))
        source.release(force=True)
        return made

    def producer(unit: tuple[str, int, str], item: str) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            if held["unit"] != unit or item not in held["tensors"]:
                held["unit"], held["tensors"] = None, {}
                held["tensors"], held["unit"] = make_unit(unit), unit
            # handed over, not kept: the unit shrinks as its tensors are written (DCP asks for each once)
            return held["tensors"].pop(item)
        return make

    lazy = {f"{MODEL_KEY}.{key}": producer((MODEL_KEY, unit, ""), key) for key, _, _, unit in renaming.outputs}
    if source is None:
        return model, lazy, None
    translated = hf_naming.plan_state(renaming, source)
    moments = sorted({m for values in source.moments.values() for m in values})
    for key, values in translated.state.items():
        for m, value in values.items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                fqn, unit = _moment_fqn(key, m), translated.unit_of[key]
                lazy[fqn] = producer((OPTIM_KEY, unit, m), key)
                order[fqn] = (1, unit, moments.index(m))
    return model, lazy, optimizer_dict(translated.state, translated.param_groups)
