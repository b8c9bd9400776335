"""Activations saved for backward per distributed transformer layer: ``flash_attention=True`` (PyTorch's
scaled_dot_product_attention) against ``flash_attention=False`` (explicit scores and probabilities).

One GPT-2-like pre-layernorm ``smp.nn.DistributedTransformerLayer`` (tensor_parallel_degree 1, in this
process, fp32, training mode) runs forward at each ``--seq``; the bytes autograd saves for backward are
counted with ``saved_tensors_hooks`` (:mod:`smp2ds.engine.diagnostics.saved_activations`: each storage once,
parameters left out). ``S x S`` is the part held in ``[N, heads or 1, S, S]`` tensors (scores,
probabilities, dropout masks, a combined mask). Three cases:

* ``causal``: the causal mask only (SDPA gets ``is_causal=True``);
* ``causal+pad``: with an additive padding mask (SDPA gets one float ``attn_mask``);
* ``dropout``: causal, attention dropout 0.1 (SDPA's ``dropout_p``).

Which SDPA kernel runs decides the saving: on CPU PyTorch's fused (flash) CPU kernel takes the first two
cases and keeps only its output and log-sum-exp; it has no dropout, so the third falls back to the math
kernel, which keeps the probabilities like the eager path. On GPUs the FlashAttention kernels take dropout
too (not measured here: no GPU on this machine). Forward + backward wall time (median of ``--repeat``) is
printed as well.

    python bench/attention_memory.py [--seq 256 512 1024 2048] [--hidden 256] [--heads 8] [--batch 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

import smdistributed.modelparallel.torch as smp  # noqa: E402
from smp2ds.engine.diagnostics.saved_activations import saved_activations  # noqa: E402

CASES = ("causal", "causal+pad", "dropout")


def measure(args: argparse.Namespace, seq: int, case: str, flash: bool) -> dict:
    """Saved bytes (all, and the S x S part) and the median forward + backward seconds of one layer."""
    torch.manual_seed(0)
    layer = smp.nn.DistributedTransformerLayer(
        num_attention_heads=args.heads, attention_head_size=args.hidden // args.heads, hidden_size=args.hidden,
        intermediate_size=4 * args.hidden, attention_dropout_prob=0.1 if case == "dropout" else 0.0,
        hidden_dropout_prob=0.0, causal_mask_size=seq, pre_layernorm=True, post_layernorm=False,
        flash_attention=flash).train()
    hidden = torch.randn(args.batch, seq, args.hidden, requires_grad=True)
    mask = None
    if case == "causal+pad":
        mask = torch.zeros(args.batch, 1, 1, seq)
        mask[0, ..., seq - seq // 8:] = -1e4  # right padding in one row
    saved, _ = saved_activations(lambda: layer((hidden, mask))[0], layer.parameters())
    square = sum(b for shape, b in saved if len(shape) == 4 and shape[-1] == shape[-2] == seq)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        layer((hidden, mask))[0].square().mean().backward()
        times.append(time.perf_counter() - start)
    return {"bytes": sum(b for _, b in saved), "square": square, "seconds": statistics.median(times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"one pre-layernorm DistributedTransformerLayer, hidden {args.hidden}, {args.heads} heads, batch "
          f"{args.batch}, fp32, tp 1, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"{'case':<11}{'seq':>6}{'eager MiB':>11}{'S x S':>9}{'flash MiB':>11}{'S x S':>9}{'flash/eager':>13}"
          f"{'eager s':>10}{'flash s':>10}")
    for case in CASES:
        for seq in args.seq:
            eager, flash = measure(args, seq, case, False), measure(args, seq, case, True)
            print(f"{case:<11}{seq:>6}{eager['bytes'] / 2**20:>11.1f}{eager['square'] / 2**20:>9.1f}"
                  f"{flash['bytes'] / 2**20:>11.1f}{flash['square'] / 2**20:>9.1f}"
                  f"{flash['bytes'] / eager['bytes']:>13.3f}{eager['seconds']:>10.3f}{flash['seconds']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
