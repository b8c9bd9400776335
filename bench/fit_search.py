"""How long ``smp2ds explain --fit`` takes at cluster scale, and what tracing a few blocks saves.

Two measurements, one process:

1. one layout of LLaMA-70B (80 blocks, 8 key/value heads; tp 8 x pp 4, bf16, 8 micro-batches of 1 x 4096 tokens)
   estimated with every block traced (the baseline) and traced on one and two blocks and scaled
   (``smp2ds.engine.memory.block_scaling``): the two peaks (equal) and the ratio of the times;
2. the whole ``--fit 80GiB`` search at 64 ranks, batch 8 x 4096 (the CLI, as a user runs it): its wall time and
   what it proposes.

    DS_ACCELERATOR=cpu python3 bench/fit_search.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


def one_layout(config_path: str) -> None:
    import torch

    from smp2ds.engine.memory import estimate_memory, load_model_source
    from smp2ds.engine.memory.estimate import StepShape

    source = load_model_source(config_path)
    shape = StepShape(pipeline_stages=4, tensor_parallel=8, microbatches=8, batch_per_rank=8, seq_len=4096,
                      dtype=torch.bfloat16)
    timings = {}
    peaks = {}
    for name, scale in (("every block traced", False), ("1 and 2 blocks, scaled", True)):
        start = time.perf_counter()
        peaks[name] = estimate_memory(source, shape, scale=scale).peak
        timings[name] = time.perf_counter() - start
    for name in timings:
        print(f"  {name:24s} {timings[name]:6.1f} s   peak {peaks[name] / 2**30:8.2f} GiB")
    base, scaled = timings.values()
    print(f"  ratio (traced / scaled): {base / scaled:.1f}x; peaks equal: {len(set(peaks.values())) == 1}")


def whole_search(folder: str, config_path: str) -> None:
    smp = os.path.join(folder, "smp.json")
    with open(smp, "w", encoding="utf-8") as fh:
        json.dump({"pipeline_parallel_degree": 4, "tensor_parallel_degree": 8, "microbatches": 8, "ddp": True,
                   "bf16": True}, fh)
    argv = [sys.executable, "-m", "smp2ds.cli", "explain", smp, "--model", config_path, "--fit", "80GiB",
            "--world-size", "64", "--batch-size", "8", "--seq-len", "4096", "--format", "json"]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, check=True)
    took = time.perf_counter() - start
    report = json.loads(proc.stdout)
    best = report["fitting"][0] if report["fitting"] else None
    print(f"  wall {took:.1f} s (CLI start-up included): {report['layouts_tried']} traced, "
          f"{report['layouts_over_by_model_states']} left out by model states, {len(report['skipped'])} skipped "
          f"(the model cannot take them), {len(report['fitting'])} proposed")
    if best:
        print(f"  first: {json.dumps(best['smp_parameters'], sort_keys=True)}, "
              f"{best['step_time']['seconds_per_sample'] * 1e3:.1f} ms per sample, "
              f"peak {best['peak'] / 2**30:.2f} GiB")


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        config_path = os.path.join(folder, "config.json")
        with open(config_path, "w", encoding="utf-8") as fh:
            json.dump(LLAMA_70B, fh)
        print("LLaMA-70B, tp 8 x pp 4, one layout:")
        one_layout(config_path)
        print("LLaMA-70B, --fit 80GiB at 64 ranks:")
        whole_search(folder, config_path)


if __name__ == "__main__":
    main()
