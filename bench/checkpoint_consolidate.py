"""Memory and time of ``smp2ds checkpoint consolidate`` on a large synthetic checkpoint.

Writes a GPT-2-shaped partial checkpoint in smp2ds's on-disk format (``model_<pp>_<tp>.pt`` per
pipeline stage and tensor-parallel rank, Hugging Face GPT-2 names, ``Conv1D`` pieces cut as the
engine cuts them, the tied embedding on both stages) at tp 2 x pp 2; default size: hidden 2048,
24 layers, vocabulary 50257, 2048 positions = 1.31B fp32 parameters (5.2 GB). Then, each in its
own fresh interpreter, measures:

* ``baseline``: the interpreter with torch and smp2ds's checkpoint tools imported, nothing done;
* ``copy``: a plain read and write of the same bytes (every model file read in 64 MiB blocks and
  appended to one output file, fsynced), the floor for any tool that must read and write them;
* ``consolidate``: ``smp2ds checkpoint consolidate`` in process (safetensors, streamed), fsynced;
* with ``--smp-names``: the model in SMP's distributed-transformer names at ``--tp`` (1 or 2) x pp 2, and
  ``dcp-hf`` instead: ``smp2ds checkpoint export --to dcp`` translating them to Hugging Face's a layer at a time;
* with ``--smp-names --optimizer``: Adam's state beside them too (``optimizer_states_<pp>_<tp>.pt``, fp32 as an
  unsharded smp2ds save writes it: step, two moments per parameter, two weight-decay groups), and ``dcp-hf``
  and ``universal-hf`` (``export --to deepspeed-universal``, which needs that state) measured.

and prints peak RSS above the baseline (``VmHWM``, which counts mapped file pages touched)
and wall time against the copy. Target (issue 23): peak <= 1.5 GB above the interpreter, time
<= 2x the copy. The page cache is not dropped (a shared machine); the runs alternate copy /
consolidate ``--rounds`` times so both meet the same cache state, and medians are reported.

Usage: python bench/checkpoint_consolidate.py [--hidden 2048 --layers 24] [--dir /tmp/ckpt-bench]
       [--rounds 2] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, time
import torch
from smp2ds.engine.checkpoint_tools import checkpoint_folder, consolidate
mode, src, out = sys.argv[1:4]
start = time.perf_counter()
if mode == "copy":
    with open(out, "wb") as dst:
        for name in sorted(os.listdir(src)):
            if name.startswith(("model_", "optimizer_")):
                with open(os.path.join(src, name), "rb") as handle:
                    while block := handle.read(64 << 20):
                        dst.write(block)
        dst.flush(); os.fsync(dst.fileno())
elif mode == "consolidate":
    consolidate.consolidate(checkpoint_folder.find(src), out)
    with open(out, "rb") as handle:
        os.fsync(handle.fileno())
elif mode == "dcp-hf":  # the distributed transformer's names translated to Hugging Face's, a layer at a time
    from smp2ds.engine.checkpoint_tools import dcp_export, hf_export
    dcp_export.export(checkpoint_folder.find(src), out, hf_export.translator("gpt2", 16))
    os.sync()
elif mode == "universal-hf":
    from smp2ds.engine.checkpoint_tools import hf_export, universal_export
    universal_export.export(checkpoint_folder.find(src), out, hf_export.translator("gpt2", 16))
    os.sync()
# VmHWM: this process's own peak (ru_maxrss would carry the parent's peak across fork and exec)
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"seconds": time.perf_counter() - start, "peak_rss_bytes": peak}))
"""


def write_checkpoint(folder: str, hidden: int, layers: int, vocab: int, positions: int) -> int:
    """The tp 2 x pp 2 partial files; returns the number of parameters of the full model."""
    import torch

    from smp2ds.engine.nn.parallel.shards import ShardSpec

    part = os.path.join(folder, "bench_partial")
    os.makedirs(part, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shared = {"transformer.wte.weight": torch.randn(vocab, hidden, generator=g),
              "transformer.wpe.weight": torch.randn(positions, hidden, generator=g)}
    shared["lm_head.weight"] = shared["transformer.wte.weight"]
    params = sum(t.numel() for k, t in shared.items() if k != "lm_head.weight")
    block = {"ln_1.weight": ((hidden,), None), "ln_1.bias": ((hidden,), None),
             "attn.c_attn.weight": ((hidden, 3 * hidden), ShardSpec(1, 2, 3)),
             "attn.c_attn.bias": ((3 * hidden,), ShardSpec(0, 2, 3)),
             "attn.c_proj.weight": ((hidden, hidden), ShardSpec(0, 2)), "attn.c_proj.bias": ((hidden,), None),
             "ln_2.weight": ((hidden,), None), "ln_2.bias": ((hidden,), None),
             "mlp.c_fc.weight": ((hidden, 4 * hidden), ShardSpec(1, 2)),
             "mlp.c_fc.bias": ((4 * hidden,), ShardSpec(0, 2)),
             "mlp.c_proj.weight": ((4 * hidden, hidden), ShardSpec(0, 2)), "mlp.c_proj.bias": ((hidden,), None)}
    for stage in (0, 1):
        mine = range(stage * layers // 2, (stage + 1) * layers // 2)
        files: list[dict] = [{"_smp_is_partial": True}, {"_smp_is_partial": True}]
        for i in mine:
            for name, (shape, spec) in block.items():
                full = torch.randn(*shape, generator=g)
                params += full.numel()
                for rank in (0, 1):
                    files[rank][f"transformer.h.{i}.{name}"] = spec.local(full, rank) if spec else full
        ends = ("transformer.wte.weight", "transformer.wpe.weight") if stage == 0 else \
            ("lm_head.weight", "transformer.ln_f.weight", "transformer.ln_f.bias")
        for key in ends:
            value = shared.get(key, torch.ones(hidden))
            if key in ("transformer.ln_f.weight", "transformer.ln_f.bias"):
                params += hidden
            for rank in (0, 1):
                files[rank][key] = value
        for rank in (0, 1):
            torch.save(files[rank], os.path.join(part, f"model_{stage}_{rank}.pt"))
        del files
    torch.save({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2}, os.path.join(part, "smp_config.pt"))
    return params


def write_smp_named(folder: str, hidden: int, layers: int, vocab: int, positions: int, tp: int = 1,
                    optimizer: bool = False) -> int:
    """The same model in SMP's distributed-transformer names (``transformer.seq_layers.<i>.attention.query``, ...)
    at tp ``tp`` x pp 2, as a distributed-transformer run's partial files hold them; returns the parameter count."""
    import torch

    from smp2ds.engine.checkpoint_tools.shard_rules import name_splits
    from smp2ds.engine.nn.huggingface.gpt2 import translate_hf_state_dict_to_smdistributed_gpt2_layer
    from smp2ds.engine.nn.parallel.shards import ShardSpec

    part = os.path.join(folder, "bench_partial")
    os.makedirs(part, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shapes = {"ln_1.weight": (hidden,), "ln_1.bias": (hidden,), "attn.c_attn.weight": (hidden, 3 * hidden),
              "attn.c_attn.bias": (3 * hidden,), "attn.c_proj.weight": (hidden, hidden), "attn.c_proj.bias": (hidden,),
              "ln_2.weight": (hidden,), "ln_2.bias": (hidden,), "mlp.c_fc.weight": (hidden, 4 * hidden),
              "mlp.c_fc.bias": (4 * hidden,), "mlp.c_proj.weight": (4 * hidden, hidden), "mlp.c_proj.bias": (hidden,)}
    embedding = torch.randn(vocab, hidden, generator=g)
    params = embedding.numel() + positions * hidden + 2 * hidden
    for stage in (0, 1):
        sd: dict = {"_smp_is_partial": True}
        if stage == 0:
            sd.update({"word_embedding.weight": embedding, "position_embedding.weight":
                       torch.randn(positions, hidden, generator=g)})
        for i in range(stage * layers // 2, (stage + 1) * layers // 2):
            block = {k: torch.randn(*v, generator=g) for k, v in shapes.items()}
            params += sum(t.numel() for t in block.values())
            for key, value in translate_hf_state_dict_to_smdistributed_gpt2_layer(block).items():
                sd[f"transformer.seq_layers.{i}.{key}"] = value
        if stage == 1:
            sd.update({"transformer.layernorm.weight": torch.ones(hidden), "transformer.layernorm.bias":
                       torch.zeros(hidden), "lm_head.weight": embedding})
        # each rank's piece as the engine cuts the distributed transformer (the checkpoint reader's own rules)
        splits = name_splits([k for k in sd if k != "_smp_is_partial"]) if tp > 1 else {}
        for rank in range(tp):
            local = {k: ShardSpec(split.dim, tp, split.blocks).local(v, rank) if (split := splits.get(k)) else v
                     for k, v in sd.items()}
            torch.save(local, os.path.join(part, f"model_{stage}_{rank}.pt"))
            if optimizer:
                write_adam_state(os.path.join(part, f"optimizer_states_{stage}_{rank}.pt"), local, g)
            del local
        del sd
    torch.save({"pipeline_parallel_degree": 2, "tensor_parallel_degree": tp}, os.path.join(part, "smp_config.pt"))
    return params


def write_adam_state(path: str, local: dict, g: object) -> None:
    """Adam's state of one stage and tensor-parallel rank as an unsharded smp2ds save writes it: PyTorch's
    ``optimizer.state_dict()`` (by position, two groups split by weight decay as SMP's scripts build them) with the
    parameter names smp2ds records; the tied head (the embedding again) is one parameter, so it has no state."""
    import torch

    names = [k for k in local if k != "_smp_is_partial" and k != "lm_head.weight"]
    decay = [n for n in names if n.endswith("weight") and "layernorm" not in n and "embedding" not in n]
    groups = [decay, [n for n in names if n not in decay]]
    order = [n for group in groups for n in group]
    state = {i: {"step": torch.tensor(2.0), "exp_avg": torch.randn(local[n].shape, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(local[n].shape, generator=g) * 1e-6} for i, n in enumerate(order)}
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False}
    param_groups, start = [], 0
    for group, decay_rate in zip(groups, (0.01, 0.0)):
        param_groups.append({**hyper, "weight_decay": decay_rate, "params": list(range(start, start + len(group)))})
        start += len(group)
    torch.save({"ds_optimizer": {"state": state, "param_groups": param_groups},
                "smp2ds": {"zero_stage": 0, "precision": "fp32", "param_names": groups}}, path)


def run(mode: str, src: str, out: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", CHILD, mode, src, out], env=env, check=True, capture_output=True,
                          text=True)
    if os.path.isdir(out):
        shutil.rmtree(out)
    elif os.path.exists(out):
        os.unlink(out)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--dir", default="/tmp/smp2ds-ckpt-bench")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint")
    ap.add_argument("--tp", type=int, choices=(1, 2), default=1, help="with --smp-names: the tensor-parallel degree")
    ap.add_argument("--optimizer", action="store_true",
                    help="with --smp-names: write Adam's state too and measure the DCP and universal exports")
    ap.add_argument("--smp-names", action="store_true",
                    help="write the distributed transformer's names at tp 1 x pp 2 and measure `export --to dcp` "
                    "translating them to Hugging Face's (instead of consolidate)")
    args = ap.parse_args()
    src = os.path.join(args.dir, "bench_partial")
    t0 = time.perf_counter()
    measured = ["dcp-hf", "universal-hf"] if args.optimizer else ["dcp-hf"] if args.smp_names else ["consolidate"]
    if args.smp_names:
        params = write_smp_named(args.dir, args.hidden, args.layers, args.vocab, args.positions, args.tp,
                                 args.optimizer)
    else:
        params = write_checkpoint(args.dir, args.hidden, args.layers, args.vocab, args.positions)
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.startswith(("model_", "optim")))
    print(f"synthetic checkpoint: {params / 1e9:.3f}B fp32 parameters, "
          f"{f'SMP names, tp {args.tp}' if args.smp_names else 'tp 2'} x pp 2, {size / 1e9:.2f} GB of model "
          f"{'and optimizer ' if args.optimizer else ''}files (written in {time.perf_counter() - t0:.0f} s)")
    out = os.path.join(args.dir, "out.bin")
    runs: dict[str, list[dict]] = {name: [] for name in ("copy", *measured)}
    try:
        base = run("baseline", src, out)
        for _ in range(args.rounds):
            for name in runs:
                runs[name].append(run(name, src, out))
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    med = {name: {k: statistics.median(r[k] for r in done) for k in ("seconds", "peak_rss_bytes")}
           for name, done in runs.items()}
    gb = 1e9
    print(f"interpreter baseline peak RSS: {base['peak_rss_bytes'] / gb:.2f} GB")
    for name, m in med.items():
        rounds = ", ".join(f"{r['seconds']:.1f}" for r in runs[name])
        print(f"{name:<12} wall {m['seconds']:.1f} s (rounds: {rounds}), peak RSS above "
              f"baseline {(m['peak_rss_bytes'] - base['peak_rss_bytes']) / gb:.2f} GB")
    for name in measured:
        ratio = med[name]["seconds"] / med["copy"]["seconds"]
        above = (med[name]["peak_rss_bytes"] - base["peak_rss_bytes"]) / gb
        print(f"{name} / copy time: {ratio:.2f}x (target <= 2x); peak RSS above the interpreter {above:.2f} GB "
              "(target <= 1.5 GB)")

if __name__ == "__main__":
    main()
