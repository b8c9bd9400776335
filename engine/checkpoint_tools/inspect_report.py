"""``smp2ds checkpoint inspect``: what a checkpoint folder holds and what is wrong with it."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

from smp2ds.engine.checkpoint_tools import checkpoint_folder, consolidate
from smp2ds.engine.checkpoint_tools.checkpoint_folder import Problem
from smp2ds.engine.exceptions import SMPCheckpointError


def report(path: str, tag: str | None = None, tensors: bool = False) -> dict[str, Any]:
    """The inspect report of ``path`` as a JSON-ready dict; ``complete`` is False when anything is wrong.

    A folder that cannot be read as a checkpoint at all gives a report with that one problem. ``tensors``: also
    every tensor of the full state dict, ``{name: {"shape", "dtype", "split"}}`` (``split``: the dimension the
    tensor-parallel ranks cut, or None).
    """
    try:
        found = checkpoint_folder.find(path, tag)
    except SMPCheckpointError as exc:
        file, _, message = str(exc).partition(": ")
        return {"path": path, "complete": False, "problems": [{"file": file, "message": message or str(exc)}]}
    entries, problems = consolidate.plan(found)
    problems = found.problems + [p for p in problems if p not in found.problems]
    params = sum(_numel(e.shape) for e in entries)
    world = (found.manifest or {}).get("layout", {}).get("world_size")
    listing = {"tensor_list": {e.key: {"shape": list(e.shape), "dtype": str(e.dtype).replace("torch.", ""),
                                       "split": e.split.dim if e.split is not None else None} for e in entries}
               } if tensors else {}
    return {**listing,
        "path": path,
        "directory": found.directory,
        "kind": found.kind,
        "tag": found.tag,
        "newest": found.newest[-1] if found.newest else None,
        "checkpoints": found.newest,
        "layout": {"pipeline_parallel_degree": found.pp, "tensor_parallel_degree": found.tp, "rdp": found.rdp,
                   "sharded_data_parallel_degree": found.sdp, "world_size": world},
        "model_files": {f"{p}_{t}": os.path.basename(f) for (p, t), f in sorted(found.model_files.items())},
        "optimizer_files": sorted(os.path.basename(f) for f in found.optimizer_files.values()),
        "optimizer_state": bool(found.optimizer_files),
        "optimizer_sharded": found.optimizer_sharded,
        "scheduler": "scheduler" in found.extras,
        "user_content": "user_content" in found.extras,
        "manifest": found.manifest is not None,
        "parameters": params,
        "tensors": len(entries),
        "dtypes": dict(sorted(Counter(str(e.dtype).replace("torch.", "") for e in entries).items())),
        "tensor_parallel_split": sum(1 for e in entries if e.split is not None),
        "problems": [{"file": p.file, "message": p.message} for p in problems],
        "complete": not problems,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for extent in shape:
        n *= extent
    return n


def render_json(rep: dict[str, Any]) -> str:
    return json.dumps(rep, indent=1) + "\n"


def render_text(rep: dict[str, Any]) -> str:
    """The human table: one line per fact, then every problem with its file."""
    if "layout" not in rep:
        return "checkpoint: UNREADABLE\n" + "".join(_problem_line(p) for p in rep["problems"])
    lay = rep["layout"]
    rows = [
        ("folder", rep["directory"]),
        ("kind", rep["kind"]),
        ("tag", rep["tag"] or "-"),
        ("newest", rep["newest"] or "-"),
        ("layout", f"pp {lay['pipeline_parallel_degree']} x tp {lay['tensor_parallel_degree']} x rdp "
                   f"{lay['rdp'] if lay['rdp'] is not None else '?'} (sdp {lay['sharded_data_parallel_degree']})"),
        ("model files", " ".join(rep["model_files"].values())),
        ("parameters", f"{rep['parameters']:,} in {rep['tensors']} tensors "
                       f"({rep['tensor_parallel_split']} split over tp)"),
        ("dtypes", ", ".join(f"{k} x{v}" for k, v in rep["dtypes"].items()) or "-"),
        ("optimizer", ("sharded, " if rep["optimizer_sharded"] else "") + f"{len(rep['optimizer_files'])} file(s)"
         if rep["optimizer_state"] else "absent"),
        ("scheduler", "present" if rep["scheduler"] else "absent"),
        ("user content", "present" if rep["user_content"] else "absent"),
        ("manifest", "present (sizes and SHA-256 checked)" if rep["manifest"] else "absent (written by SMP?)"),
        ("status", "complete" if rep["complete"] else f"INCOMPLETE: {len(rep['problems'])} problem(s)"),
    ]
    width = max(len(k) for k, _ in rows)
    text = "".join(f"{k:<{width}}  {v}\n" for k, v in rows)
    text += "".join(_problem_line(p) for p in rep["problems"])
    if "tensor_list" in rep:
        name_width = max((len(k) for k in rep["tensor_list"]), default=0)
        text += "tensors\n" + "".join(
            f"  {name:<{name_width}}  {'x'.join(map(str, t['shape'])) or 'scalar'}  {t['dtype']}"
            + (f"  (split over tp along dim {t['split']})" if t["split"] is not None else "") + "\n"
            for name, t in rep["tensor_list"].items())
    return text


def _problem_line(p: dict[str, str] | Problem) -> str:
    file, message = (p["file"], p["message"]) if isinstance(p, dict) else (p.file, p.message)
    return f"  problem: {file}: {message}\n"
