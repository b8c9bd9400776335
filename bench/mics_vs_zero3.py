"""MiCS (S = ranks per node) vs DeepSpeed ZeRO-3 over all ranks: cross-node bytes, memory, step time.

Two simulated nodes x 2 ranks, the launcher run once per node with node ranks
(``torchrun --nnodes 2 --node-rank i``), same model, data and optimizer for every variant.

    python bench/mics_vs_zero3.py            # loopback "nodes" (any machine)
    python bench/mics_vs_zero3.py --netns    # also: two network namespaces over a 200 Mbit/s veth (root)

Definitions (what the numbers mean):

* M = bytes of one copy of the parameters in the training dtype (fp32 here: 4 x numel).
* cross-node bytes / step: per rank, the ring-model bytes (comm_counter.CommRecord.ring_bytes) of
  every collective whose process group holds ranks of both nodes, summed over the measured
  optimizer steps and divided by their number; the table shows the mean over ranks. For MiCS
  with S = ranks per node only the replica all-reduce of the gradient partition crosses.
* formula: mapping-anchors.md section 1.2: MiCS 2 (R-1)/R * M/S; ZeRO-3 3 s (N-1)/N * M (s =
  micro-batches per step; an upper bound for ZeRO-3 because a ring over 4 ranks on 2 nodes also
  has node-local links).
* model-state bytes / rank: parameters + gradients + fp32 master + Adam state this rank holds,
  measured from the partitions (mics.partition_stats); "fraction" = that / unsharded size.
* wire bytes / step (netns only): tx+rx bytes counted by the kernel on node 0's veth during the
  measured steps, divided by steps (all ranks' traffic over the link, with TCP/IP headers).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------------------- worker side
def _worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from smp2ds.engine import mics
    from smp2ds.engine.diagnostics import comm_counter
    from smp2ds.translator.topology import Topology

    dist.init_process_group("gloo")
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    numel = sum(p.numel() for p in model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.gas,
        "gradient_clipping": 1.0, "steps_per_print": 10**9,
        # Persistence 0: every tensor is partitioned, as the formulas assume.
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 500_000_000,
                              "stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 1_000_000_000},
    }
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if args.mode == "mics":
        groups = mics.MicsGroups.create(Topology(rdp=world), per_node, ranks_per_node=per_node)
        engine, _ = mics.initialize(model, opt, cfg, groups)
    else:
        if args.mode == "ddp":
            cfg["zero_optimization"] = {"stage": 0}
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.micro, args.hidden, generator=g)
    y = torch.randn(args.micro, args.hidden, generator=g)

    def optimizer_step() -> None:
        for _ in range(args.gas):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()

    for _ in range(args.warmup):
        optimizer_step()
    veth = os.environ.get("SMP2DS_BENCH_VETH")
    wire0 = _wire_bytes(veth) if veth and rank == 0 else 0
    counter = comm_counter.CommCounter()
    dist.barrier()
    t0 = time.perf_counter()
    with counter:
        for _ in range(args.steps):
            optimizer_step()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    wire = (_wire_bytes(veth) - wire0) / args.steps if veth and rank == 0 else None
    if args.mode == "ddp":
        state = numel * 4 * 4  # params + grads + exp_avg + exp_avg_sq, all fp32, unsharded
        stats = {"model_state_bytes": state, "full_model_state_bytes": state, "fraction": 1.0}
    else:
        stats = mics.partition_stats(engine)
    mine = {"rank": rank, "cross": counter.cross_node_ring_bytes(per_node) / args.steps,
            "total": counter.total_ring_bytes() / args.steps, "step_s": elapsed / args.steps,
            "state_bytes": stats["model_state_bytes"], "full_state_bytes": stats["full_model_state_bytes"],
            "fraction": stats["fraction"], "M": numel * 4, "wire": wire,
            "syncs": getattr(engine.optimizer, "mics_replica_syncs", None)}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(everyone, fh)
    dist.barrier()
    dist.destroy_process_group()


def _wire_bytes(dev: str) -> int:
    base = f"/sys/class/net/{dev}/statistics"
    return sum(int(open(f"{base}/{k}_bytes").read()) for k in ("tx", "rx"))


# ------------------------------------------------------------------------------- driver side
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str, gas: int, opts: argparse.Namespace, node_cmd: list[list[str]], node_env: list[dict],
            master: str, port: int) -> list[dict]:
    """Run one variant: one torchrun per node, node ranks 0 and 1; return the per-rank results."""
    with tempfile.TemporaryDirectory(prefix="smp2ds-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        procs = []
        for node in (0, 1):
            cmd = node_cmd[node] + [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "2", "--master-addr", master, "--master-port", str(port), HERE, "--worker",
                "--mode", mode, "--gas", str(gas), "--steps", str(opts.steps), "--warmup", str(opts.warmup),
                "--hidden", str(opts.hidden), "--layers", str(opts.layers), "--micro", str(opts.micro), "--out", out]
            env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", **node_env[node])
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = []
        try:
            for p in procs:
                logs.append(p.communicate(timeout=opts.timeout)[0])
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(p.returncode for p in procs) or not os.path.exists(out):
            tail = "\n".join(line for log in logs for line in log.splitlines()[-15:])
            raise RuntimeError(f"{mode} gas={gas} failed:\n{tail}")
        with open(out) as fh:
            return json.load(fh)


def _summarise(rows: list[dict]) -> dict:
    n = len(rows)
    return {"cross": sum(r["cross"] for r in rows) / n, "total": sum(r["total"] for r in rows) / n,
            "step_s": max(r["step_s"] for r in rows), "state": max(r["state_bytes"] for r in rows),
            "full_state": rows[0]["full_state_bytes"], "fraction": max(r["fraction"] for r in rows),
            "M": rows[0]["M"], "wire": rows[0]["wire"], "syncs": rows[0]["syncs"]}


def _formula(mode: str, m: float, gas: int, world: int = 4, per_node: int = 2) -> float:
    if mode == "mics":
        s, r = per_node, world // per_node
        return 2 * (r - 1) / r * m / s
    if mode == "zero3":
        return 3 * gas * (world - 1) / world * m
    return 2 * (world - 1) / world * m  # plain DP: one all-reduce of the gradients


def _report_bytes(results: dict, gases: list[int]) -> bool:
    print("\n== per optimizer step, 4 ranks as 2 nodes x 2 (loopback), fp32, "
          f"M = {results[('mics', gases[0])]['M'] / 1e6:.2f} MB ==")
    print(f"{'variant':<14}{'gas':>4}{'cross-node MB/rank':>20}{'formula MB':>12}{'meas/formula':>14}"
          f"{'state MB/rank':>15}{'fraction':>10}{'step s':>9}")
    ok = True
    for gas in gases:
        for mode in ("mics", "zero3"):
            r = results[(mode, gas)]
            f = _formula(mode, r["M"], gas)
            print(f"{mode:<14}{gas:>4}{r['cross'] / 1e6:>20.3f}{f / 1e6:>12.3f}{r['cross'] / f:>14.3f}"
                  f"{r['state'] / 1e6:>15.2f}{r['fraction']:>10.4f}{r['step_s']:>9.3f}")
        mi, z3 = results[("mics", gas)], results[("zero3", gas)]
        within = abs(mi["cross"] / _formula("mics", mi["M"], gas) - 1) <= 0.10
        below = mi["cross"] < z3["cross"]
        mem = abs(mi["fraction"] - 0.5) <= 0.01 * 0.5
        ok &= within and below and mem
        print(f"  ratios gas={gas}: MiCS/ZeRO-3 cross-node bytes {mi['cross'] / z3['cross']:.3f}, "
              f"step time {mi['step_s'] / z3['step_s']:.2f}, MiCS state fraction {mi['fraction']:.4f} (1/S = 0.5); "
              f"targets: within 10% of formula {'OK' if within else 'MISSED'}, below ZeRO-3 "
              f"{'OK' if below else 'MISSED'}, 1/S within 1% {'OK' if mem else 'MISSED'}")
    return ok


# ------------------------------------------------------------------------------- netns
class Namespaces:
    """Two network namespaces joined by a rate-limited veth pair; removed on exit (root only)."""

    def __init__(self, rate: str) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"smp2ds-mics-{tag}-0", f"smp2ds-mics-{tag}-1"]
        self.dev = [f"smv{tag}a", f"smv{tag}b"]
        self.ip = ["10.77.0.1", "10.77.0.2"]
        self.rate = rate

    def __enter__(self) -> Namespaces:  # noqa: PYI034 - python 3.10 has no typing.Self
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for i in (0, 1):
                _ip("link", "set", self.dev[i], "netns", self.ns[i])
                _ip("-n", self.ns[i], "addr", "add", f"{self.ip[i]}/24", "dev", self.dev[i])
                _ip("-n", self.ns[i], "link", "set", "lo", "up")
                _ip("-n", self.ns[i], "link", "set", self.dev[i], "up")
                subprocess.run(["tc", "-n", self.ns[i], "qdisc", "add", "dev", self.dev[i], "root", "tbf", "rate",
                                self.rate, "burst", "32kbit", "latency", "50ms"], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            self.__exit__()
            detail = exc.stderr.decode().strip() if isinstance(exc, subprocess.CalledProcessError) else str(exc)
            raise RuntimeError(f"cannot create network namespaces ({detail}); this part needs root with "
                               "CAP_NET_ADMIN and the ip/tc tools") from None
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.ns:  # deleting a namespace also deletes its end of the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _run_netns(opts: argparse.Namespace) -> None:
    print(f"\n== two network namespaces, veth limited to {opts.rate} (tc tbf), 2 ranks each ==")
    try:
        with Namespaces(opts.rate) as net:
            cmds = [["ip", "netns", "exec", ns] for ns in net.ns]
            envs = [{"GLOO_SOCKET_IFNAME": net.dev[i], "SMP2DS_BENCH_VETH": net.dev[i] if i == 0 else ""}
                    for i in (0, 1)]
            print(f"{'variant':<10}{'gas':>4}{'step s':>9}{'vs ZeRO-3':>11}{'wire MB/step':>14}"
                  f"{'counter MB/step (all ranks)':>29}")
            for gas in (1, 4):
                rows = {}
                for mode in ("mics", "zero3", "ddp"):
                    rows[mode] = _summarise(_launch(mode, gas, opts, cmds, envs, net.ip[0], _free_port()))
                for mode, r in rows.items():
                    print(f"{mode:<10}{gas:>4}{r['step_s']:>9.3f}{r['step_s'] / rows['zero3']['step_s']:>11.2f}"
                          f"{(r['wire'] or 0) / 1e6:>14.2f}{4 * r['cross'] / 1e6:>29.2f}")
    except RuntimeError as exc:
        print(f"netns part skipped: {exc}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="mics", choices=("mics", "zero3", "ddp"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--gas", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=4, help="measured optimizer steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps before measuring")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro", type=int, default=4, help="samples per micro-batch per rank")
    p.add_argument("--netns", action="store_true", help="also run on two network namespaces (root)")
    p.add_argument("--netns-only", action="store_true", help="only the network-namespace part")
    p.add_argument("--rate", default="200mbit", help="veth bandwidth for --netns")
    p.add_argument("--timeout", type=float, default=600)
    opts = p.parse_args(argv)
    if opts.worker:
        _worker(opts)
        return 0
    if opts.netns_only:
        _run_netns(opts)
        return 0
    gases = [1, 4]
    loopback = [{"GLOO_SOCKET_IFNAME": "lo"}] * 2
    results = {(mode, gas): _summarise(_launch(mode, gas, opts, [[], []], loopback, "127.0.0.1", _free_port()))
               for gas in gases for mode in ("mics", "zero3")}
    ok = _report_bytes(results, gases)
    if opts.netns:
        _run_netns(opts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
