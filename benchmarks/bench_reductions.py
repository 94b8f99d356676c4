"""Topology-invariant reductions vs c10d's, on gloo ranks of this machine (one interleaved run).

For each world size and buffer size: rounds of {c10d all_reduce, invariant all_reduce, c10d
reduce_scatter, invariant reduce_scatter}, order alternating per round, a barrier before each op,
the slowest rank's time kept; medians and the paired ratio invariant / c10d per round.

    python benchmarks/bench_reductions.py [--ranks 2 4] [--mib 1 16] [--rounds 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_bitdet.kernels.reductions import CollectiveTransport, Reductions


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item() * 1e3


def _rank(rank, world, init, mib_list, rounds, warmup, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    inv = Reductions(CollectiveTransport())
    results = {}
    for mib in mib_list:
        n = mib * 2**20 // 4 // world * world
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        shard = torch.empty(n // world)
        ops = {
            "all_reduce/c10d": lambda: dist.all_reduce(x.clone()),
            "all_reduce/invariant": lambda: inv.all_reduce(x.clone()),
            "reduce_scatter/c10d": lambda: dist.reduce_scatter_tensor(shard, x),
            "reduce_scatter/invariant": lambda: inv.reduce_scatter_tensor(shard, x),
        }
        names = list(ops)
        times = {k: [] for k in names}
        for r in range(warmup + rounds):
            for k in (names if r % 2 == 0 else names[::-1]):
                t = _timed(ops[k])
                if r >= warmup:
                    times[k].append(t)
        results[mib] = times
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"{'ranks':>5} {'MiB':>4} {'op':<15} {'c10d ms':>9} {'invariant ms':>13} {'paired ratio':>13}")
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            q = ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(r, world, f"file://{os.path.join(tmp, 'pg')}", args.mib,
                                                    args.rounds, args.warmup, q)) for r in range(world)]
            for p in procs:
                p.start()
            results = q.get()
            for p in procs:
                p.join()
        for mib, times in results.items():
            for op in ("all_reduce", "reduce_scatter"):
                base, inv = times[f"{op}/c10d"], times[f"{op}/invariant"]
                ratio = statistics.median(i / b for i, b in zip(inv, base))
                print(f"{world:>5} {mib:>4} {op:<15} {statistics.median(base):>9.2f} "
                      f"{statistics.median(inv):>13.2f} {ratio:>12.2f}x")


if __name__ == "__main__":
    main()
