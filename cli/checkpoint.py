"""``smp2ds checkpoint``: inspect, consolidate, export and reshard SMP checkpoints offline.

``inspect PATH`` reports the layout and every problem (exit 1 when incomplete or corrupt);
``consolidate PATH --out FILE`` writes one full state dict; ``export PATH --to hf DIR`` writes a
Hugging Face model directory, ``--to dcp DIR`` a torch.distributed.checkpoint directory,
``--to deepspeed-universal DIR`` a DeepSpeed universal checkpoint;
``reshard PATH --out DIR --tp N --pp M`` re-cuts a checkpoint for another layout. The work lives
in ``smp2ds.engine.checkpoint_tools`` (it needs torch); it is imported inside the command, so
the rest of the CLI stays torch-free.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import EXIT_INVALID, EXIT_USAGE, command_parser, positive_int


def checkpoint_command_parser(subparsers: Any = None) -> argparse.ArgumentParser:
    """Register ``checkpoint`` (or build a standalone parser when ``subparsers`` is None)."""
    description = ("Read SMP / smp2ds checkpoints without a distributed job: inspect a folder, consolidate its "
                   "partial files into one state dict, export a Hugging Face or torch.distributed.checkpoint "
                   "directory, or reshard.")
    parser = command_parser(subparsers, "checkpoint", description)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    ins = actions.add_parser("inspect", help="layout, tag, parameters and problems of a checkpoint folder")
    _add_path(ins)
    ins.add_argument("--format", choices=("text", "json"), default="text", help="a table for people or JSON")
    ins.add_argument("--tensors", action="store_true", help="also list every tensor of the full state dict: name, "
                     "shape, dtype and the dimension tensor parallelism cuts")

    con = actions.add_parser("consolidate", help="partial files -> one full state dict (safetensors or .pt)")
    _add_path(con)
    con.add_argument("--out", required=True, metavar="FILE", help="the file to write")
    con.add_argument("--format", choices=("safetensors", "pt"), default="safetensors",
                     help="safetensors (streamed, default) or a torch.save .pt file (built in memory)")
    con.add_argument("--with-optimizer", action="store_true", help="also write the optimizer state "
                     "by parameter name to <out stem>.optimizer.pt (unsharded fp32 state only)")
    con.add_argument("--quiet", action="store_true", help="no progress bar or summary")

    exp = actions.add_parser("export", help="a checkpoint other frameworks open: a Hugging Face model directory, "
                             "a torch.distributed.checkpoint (DCP) directory or a DeepSpeed universal checkpoint")
    _add_path(exp)
    exp.add_argument("--to", required=True, nargs=2, metavar=("FORMAT", "DIR"),
                     help="hf DIR (with --config or --model-type, else the model_config the checkpoint's user content "
                     "holds); dcp DIR (model and optimizer state by "
                     "parameter name, for dcp.load + set_state_dict at any world size); deepspeed-universal DIR "
                     "(DeepSpeed's universal checkpoint: load_universal at any ZeRO stage and data-parallel size)")
    source = exp.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="FILE", help="the model's Hugging Face config.json (--to hf; for dcp / "
                        "deepspeed-universal the family whose names a distributed-transformer checkpoint takes)")
    source.add_argument("--model-type", metavar="TYPE", help="gpt2, llama or gpt_neox (--to hf: sizes read from the "
                        "shapes; dcp / deepspeed-universal: the family to translate SMP's names for)")
    exp.add_argument("--num-attention-heads", type=positive_int, metavar="N",
                     help="attention heads (with --model-type: no shape holds the head count)")
    exp.add_argument("--names", choices=("hf", "smp"), default="hf",
                     help="dcp / deepspeed-universal of a distributed-transformer checkpoint: Hugging Face's "
                     "parameter names (default; the family from --model-type / --config or the user content's "
                     "model_config) or SMP's (transformer.seq_layers.*)")
    exp.add_argument("--quiet", action="store_true", help="no summary")
    res = actions.add_parser("reshard", help="re-cut weights and optimizer state for another tp / rdp layout")
    _add_path(res)
    res.add_argument("--out", required=True, metavar="DIR", help="the checkpoint folder to write (resume from it)")
    res.add_argument("--tp", required=True, type=positive_int, metavar="N", help="new tensor_parallel_degree")
    res.add_argument("--pp", required=True, type=positive_int, metavar="M",
                     help="pipeline_parallel_degree (must stay the checkpoint's)")
    ranks = res.add_mutually_exclusive_group()
    ranks.add_argument("--rdp", type=positive_int, metavar="R", help="new data-parallel degree (default 1)")
    ranks.add_argument("--world", type=positive_int, metavar="W", help="new world size (rdp = W / (tp x pp))")
    res.add_argument("--sdp", type=positive_int, metavar="S", help="new sharded_data_parallel_degree (default: the "
                     "saved one; a checkpoint of a sharded data-parallel run only)")
    res.add_argument("--quiet", action="store_true", help="no summary")
    parser.set_defaults(handler=checkpoint_command)
    return parser


def _add_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="the folder given to smp.save_checkpoint, one <tag>_partial "
                        "folder, or a Trainer checkpoint-N folder of an SMP run")
    parser.add_argument("--tag", help="which save of a folder holding several (default: the newest)")


def checkpoint_command(args: argparse.Namespace) -> int:
    """Run the chosen action; a refused argument is a usage error (2), a broken checkpoint exit 1."""
    # the offline checkpoint tools read tensors: torch is imported only when this command runs
    from smp2ds.engine.checkpoint_tools import commands
    from smp2ds.engine.exceptions import SMPCheckpointError, SMPError  # with the tools above

    try:
        if args.action == "inspect":
            return commands.inspect(args.path, args.tag, args.format, tensors=args.tensors)
        if args.action == "consolidate":
            return commands.consolidate(args.path, args.out, args.format, args.tag, args.with_optimizer, args.quiet)
        if args.action == "reshard":
            return commands.reshard(args.path, args.out, args.tag, args.tp, args.pp, args.rdp, args.world, args.quiet,
                                    sdp=args.sdp)
        return commands.export(args.path, args.to[0], args.to[1], args.tag, args.config, args.model_type,
                               args.num_attention_heads, args.quiet, names=args.names)
    except SMPCheckpointError as exc:
        sys.stderr.write(f"smp2ds checkpoint {args.action}: {exc}\n")
        return EXIT_INVALID
    except SMPError as exc:
        sys.stderr.write(f"smp2ds checkpoint {args.action}: error: {exc}\n")
        return EXIT_USAGE
