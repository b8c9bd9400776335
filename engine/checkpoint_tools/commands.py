"""The ``smp2ds checkpoint`` subcommands' bodies (the CLI module parses flags and calls these).

Each returns the exit code: 0 done / whole, 1 the checkpoint is incomplete or corrupt (every
problem printed with its file), and raises :class:`SMPError` subclasses for refused arguments.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

from smp2ds.engine.checkpoint_tools import (
    checkpoint_folder,
    dcp_export,
    hf_export,
    hf_naming,
    inspect_report,
    optimizer_state,
    universal_export,
)
from smp2ds.engine.checkpoint_tools import consolidate as consolidation
from smp2ds.engine.checkpoint_tools import reshard as resharding
from smp2ds.engine.exceptions import SMPCheckpointError, SMPInvalidArgumentError

EXIT_OK, EXIT_BROKEN = 0, 1


def inspect(path: str, tag: str | None, fmt: str, out: TextIO | None = None, tensors: bool = False) -> int:
    out = out or sys.stdout  # looked up per call: tests and callers swap sys.stdout
    rep = inspect_report.report(path, tag, tensors)
    out.write(inspect_report.render_json(rep) if fmt == "json" else inspect_report.render_text(rep))
    return EXIT_OK if rep["complete"] else EXIT_BROKEN


def _progress(quiet: bool, label: str) -> tuple[Callable[[int], None] | None, Any]:
    """A tqdm bar on a terminal (bytes), nothing with ``--quiet`` or when stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        return None, None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, None
    bar = tqdm(unit="B", unit_scale=True, desc=label, file=sys.stderr)
    return bar.update, bar


def _report(action: str, work: Callable[[], str], quiet: bool, err: TextIO | None) -> int:
    """Run ``work`` (it returns its summary): a broken checkpoint is exit 1 with every problem printed."""
    err = err or sys.stderr
    try:
        summary = work()
    except SMPCheckpointError as exc:
        err.write(f"smp2ds checkpoint {action}: {exc}\n")
        return EXIT_BROKEN
    if not quiet:
        err.write(summary + "\n")
    return EXIT_OK


def consolidate(path: str, out: str, fmt: str, tag: str | None, with_optimizer: bool, quiet: bool,
                err: TextIO | None = None) -> int:
    if fmt not in ("safetensors", "pt"):
        raise SMPInvalidArgumentError(f"--format {fmt!r}: allowed safetensors or pt")
    found = checkpoint_folder.find(path, tag)

    def work() -> str:
        update, bar = _progress(quiet, "consolidate")
        try:
            optimizer = _optimizer(found) if with_optimizer else None  # refused before anything is written
            entries = consolidation.consolidate(found, out, fmt, progress=update)
        finally:
            if bar is not None:
                bar.close()
        params = sum(_numel(e.shape) for e in entries)
        summary = f"wrote {out}: {len(entries)} tensors, {params:,} parameters"
        if optimizer is not None:
            consolidation.save_pt(optimizer, optimizer_state.optimizer_path(out))
            summary += (f"\nwrote {optimizer_state.optimizer_path(out)}: optimizer state of "
                        f"{len(optimizer['state'])} parameters")
        return summary

    return _report("consolidate", work, quiet, err)


def _optimizer(found: checkpoint_folder.CheckpointLayout) -> dict:
    reader = consolidation.ShardReader()
    return optimizer_state.consolidate_optimizer(found, consolidation.checked_plan(found, reader), reader)


EXPORT_FORMATS = ("hf", "dcp", "deepspeed-universal")


def export(path: str, to: str, out_dir: str, tag: str | None, config: str | None, model_type: str | None,
           heads: int | None, quiet: bool, err: TextIO | None = None, names: str = "hf") -> int:
    if to not in EXPORT_FORMATS:
        raise SMPInvalidArgumentError(f"--to {to!r}: allowed {', '.join(EXPORT_FORMATS)}")
    if names not in ("hf", "smp"):
        raise SMPInvalidArgumentError(f"--names {names!r}: allowed hf or smp")
    if to == "hf" and names == "smp":
        raise SMPInvalidArgumentError("--names smp: only for --to dcp / deepspeed-universal (a Hugging Face "
                                      "directory holds Hugging Face's names)")
    hf_export.check_model_args(config, model_type)  # before reading the folder: a usage error comes first
    found = checkpoint_folder.find(path, tag)
    if to == "hf" and config is None and model_type is None:
        hf_export.check_model_args(config, model_type, hf_export.saved_config(found) is not None)
    translate = _translation(found, config, model_type, heads, names) if to != "hf" else None

    def work() -> str:
        if to == "dcp":
            keys = dcp_export.export(found, out_dir, translate)
            return (f"wrote {out_dir}: torch.distributed.checkpoint with {' and '.join(keys)} state"
                    + (" in Hugging Face's names" if translate is not None else ""))
        if to == "deepspeed-universal":
            latest, tag = universal_export.export(found, out_dir, translate)
            return f"wrote {out_dir}: DeepSpeed universal checkpoint {tag} ({latest}, {tag}/zero/<parameter>/)"
        return f"wrote {out_dir}: {', '.join(hf_export.export(found, out_dir, config, model_type, heads))}"

    return _report("export", work, quiet, err)


def _translation(found: checkpoint_folder.CheckpointLayout, config: str | None, model_type: str | None,
                 heads: int | None, names: str) -> Any:
    """The SMP -> Hugging Face translator a DCP / universal export of ``found`` applies, or None (the checkpoint
    already holds the model's own names, or ``--names smp``); refused when the family cannot be told."""
    files = sorted(found.model_files.values())
    keys = list(consolidation.ShardReader().tensors(files[0])) if files else []
    flags = [f for f, v in (("--config", config), ("--model-type", model_type), ("--num-attention-heads", heads))
             if v is not None]
    if not hf_naming.has_smp_names(keys):
        if flags:
            raise SMPInvalidArgumentError(f"{', '.join(flags)}: the checkpoint holds no SMP distributed-transformer "
                                          "names, so there is nothing to translate; leave them out")
        return None
    if names == "smp":
        return None
    cfg = hf_export.read_config(config) if config else hf_export.saved_config(found)
    kind = model_type or (cfg or {}).get("model_type")
    count = heads or (cfg or {}).get("num_attention_heads") or (cfg or {}).get("n_head")
    if kind is None or not count:
        example = next(k for k in keys if ".seq_layers." in k)
        raise SMPInvalidArgumentError(
            f"the checkpoint holds SMP distributed-transformer names ({example}); to write Hugging Face's names the "
            "family and head count are needed: --model-type TYPE --num-attention-heads N, or --config config.json "
            "(or a model_config in the user content); --names smp keeps SMP's names")
    return hf_export.translator(kind, int(count))


def reshard(path: str, out: str, tag: str | None, tp: int, pp: int, rdp: int | None, world: int | None,
            quiet: bool, err: TextIO | None = None, sdp: int | None = None) -> int:
    ranks = resharding.target_rdp(tp, pp, rdp, world)
    found = checkpoint_folder.find(path, tag)

    def work() -> str:
        files = resharding.reshard(found, out, tp, pp, ranks, sdp)
        return f"wrote {out} for tp {tp} x pp {pp} x rdp {ranks} ({tp * pp * ranks} ranks): {', '.join(files)}"

    return _report("reshard", work, quiet, err)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for extent in shape:
        n *= extent
    return n
