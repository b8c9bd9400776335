"""Peak memory of the language-model loss with ``distribute_embedding=True``: vocab-parallel cross-entropy
(the logits stay split, ``[N, S, V/tp]`` per rank) against joining the logits and taking PyTorch's
cross-entropy (``[N, S, V]`` on every rank).

``--tp`` ranks (gloo, CPU, ``prescaled_batch: true``: every rank takes the same batch) build one
``smp.nn.DistributedTransformerLMHead`` with the vocabulary split and run forward + backward twice:

* vocab-parallel: ``model((ids, None, None, None, labels))`` -> ``(loss, None)``;
* gathered: ``model((ids,))`` -> joined logits, then ``model.loss(logits, labels)``.

Peak memory is the high-water mark of live tensor bytes during forward + backward, from PyTorch's
profiler memory timeline (every CPU allocation and free; ``torch.profiler`` ``_memory_profile()``), on
rank 0. Both losses must agree. Target: vocab-parallel peak / gathered peak <= 0.75 at tp 2 (the logits,
their softmax and gradient dominate and shrink by tp; the layers' activations do not).

    python bench/vocab_parallel_loss_memory.py [--tp 2] [--vocab 16384] [--hidden 64] [--seq 128] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch.multiprocessing as mp


def peak_bytes(fn) -> int:
    """High-water mark of live CPU tensor bytes while ``fn()`` runs (profiler memory timeline)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = top = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action.name == "CREATE":
            live += size
        elif action.name == "DESTROY":
            live -= size
        top = max(top, live)
    return top


def _worker(rank: int, args: argparse.Namespace, rdv: str, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(args.tp), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(args.tp), "SMP2DS_INIT_METHOD": rdv, "OMP_NUM_THREADS": "1",
                       "DS_ACCELERATOR": "cpu"})
    import torch

    import smdistributed.modelparallel.torch as smp

    smp.init({"ddp": True, "tensor_parallel_degree": args.tp, "prescaled_batch": True})
    model = smp.nn.DistributedTransformerLMHead(
        num_layers=1, num_attention_heads=4, attention_head_size=args.hidden // 4, hidden_size=args.hidden,
        intermediate_size=4 * args.hidden, vocab_size=args.vocab, num_positions=args.seq, causal_mask_size=args.seq,
        attention_dropout_prob=0.0, hidden_dropout_prob=0.0, embedding_dropout_prob=0.0, pre_layernorm=True,
        post_layernorm=False, distribute_embedding=True)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    losses: dict[str, float] = {}

    def vocab_parallel() -> None:
        loss, logits = model((ids, None, None, None, ids))
        assert logits is None
        loss.backward()
        losses["vocab_parallel"] = loss.item()

    def gathered() -> None:
        loss = model.loss(model((ids,)), ids)
        loss.backward()
        losses["gathered"] = loss.item()

    peaks = {}
    for name, fn in (("vocab_parallel", vocab_parallel), ("gathered", gathered)):
        fn()  # warm-up
        model.zero_grad(set_to_none=True)
        peaks[name] = peak_bytes(fn)
        model.zero_grad(set_to_none=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"peaks": peaks, "losses": losses}, f)
    smp.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--target", type=float, default=0.75)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(args, f"file://{tmp}/rdv", out), nprocs=args.tp, join=True)
        with open(out) as f:
            result = json.load(f)
    peaks, losses = result["peaks"], result["losses"]
    logits = args.batch * args.seq * args.vocab * 4
    print(f"tp {args.tp}, vocab {args.vocab}, batch {args.batch} x seq {args.seq}, hidden {args.hidden}: "
          f"full fp32 logits {logits / 2**20:.1f} MiB")
    for name in ("gathered", "vocab_parallel"):
        print(f"{name:>15}: peak {peaks[name] / 2**20:8.1f} MiB ({peaks[name] / logits:.2f} x full logits), "
              f"loss {losses[name]:.6f}")
    ratio = peaks["vocab_parallel"] / peaks["gathered"]
    same = abs(losses["vocab_parallel"] - losses["gathered"]) <= 1e-4 * abs(losses["gathered"])
    ok = ratio <= args.target and same
    print(f"vocab-parallel / gathered peak: {ratio:.3f} (target <= {args.target}); losses agree: {same} "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
