"""What one traced collective costs in a 2-rank gloo loop: the semantic level's unit cost (every
level's floor records each collective, inputs hashed before it and outputs after it completes).

ONE 2-rank launch runs rounds of three blocks of CALLS ``all_to_all_single`` calls on 32 KiB float32
tensors (the default recipe's MoE dispatch size), order shuffled every round (one seed): untraced;
inside a semantic-level traced step; and, as the control, untraced after SPIN us of busy Python before
each call (default: the traced block's main-thread CPU extra, measured on rank 0 in a warm-up round).
The control tells whether a traced call costs more than the work its wrapper does: where "traced" and
"spin" cost alike in wall time, nothing but that work (binding, digests, the record) is added. Per call:
wall time (slowest rank) and rank 0's main-thread CPU (``time.thread_time``), p50 over rounds, with the
extra over untraced. On this 2-core VM the CPU extra is steady (+39-49 us a call); the wall extra of
both "traced" and "spin" moves between 0.6x and 3x their CPU extra from run to run.

    .venv/bin/python benchmarks/bench_collective_trace.py [--rounds 20] [--calls 300] [--spin US]
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("untraced", "traced", "spin")


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def worker(rank: int, world_size: int, *, out: str, rounds: int, calls: int, spin: float | None) -> int:
    import torch
    import torch.distributed as dist

    from megatron_bitdet.trace import Tracer

    torch.set_num_threads(1)
    tracer = Tracer(Path(out).parent / "trace", rank, world_size, level="semantic")
    x = torch.randn(128, 64)
    y = torch.empty_like(x)
    split = [x.shape[0] // world_size] * world_size
    steps = itertools.count(1)

    def block(config: str, spin_us: float) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        if config == "traced":
            with tracer.step(next(steps)):
                for _ in range(calls):
                    dist.all_to_all_single(y, x, output_split_sizes=split, input_split_sizes=split)
        else:
            for _ in range(calls):
                if config == "spin":
                    _busy(spin_us)
                dist.all_to_all_single(y, x, output_split_sizes=split, input_split_sizes=split)
        return (time.perf_counter() - t0) / calls * 1e6, (time.thread_time() - c0) / calls * 1e6

    # warm-up round: the spin defaults to what tracing adds to rank 0's main thread per call
    base, traced = block("untraced", 0)[1], block("traced", 0)[1]
    cpu_extra = [traced - base]
    dist.broadcast_object_list(cpu_extra, src=0)
    spin_us = cpu_extra[0] if spin is None else spin
    times = {c: [] for c in CONFIGS}
    order = random.Random(0)
    for _ in range(rounds):
        for config in order.sample(CONFIGS, len(CONFIGS)):
            times[config].append(block(config, spin_us))
    tracer.close()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, times)
    if rank == 0:
        Path(out).write_text(json.dumps({"times": gathered, "spin_us": spin_us}))
    return 0


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from megatron_bitdet.train.launch import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--spin", type=float, default=None, help="us of busy Python before each call (default: "
                    "the traced call's main-thread CPU extra, measured in the warm-up round)")
    args = ap.parse_args()
    if args.rounds < 1 or args.calls < 1:
        ap.error("--rounds and --calls must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        rc = launch("benchmarks.bench_collective_trace:worker", 2,
                    {"out": str(out), "rounds": args.rounds, "calls": args.calls, "spin": args.spin},
                    run_dir=Path(tmp) / "launch", env={"PYTHONPATH": str(ROOT)})
        if rc != 0:
            raise SystemExit(f"benchmark launch failed (exit {rc})")
        data = json.loads(out.read_text())
    ranks = data["times"]
    wall = {c: statistics.median(max(r[c][i][0] for r in ranks) for i in range(args.rounds)) for c in CONFIGS}
    cpu = {c: statistics.median(cpu_us for _, cpu_us in ranks[0][c]) for c in CONFIGS}
    print(f"\nall_to_all_single, 32 KiB float32, 2 ranks (gloo), {args.rounds} rounds of {args.calls} calls "
          f"(order shuffled); spin = {data['spin_us']:.1f} us of busy Python before each call:")
    print(f"  {'config':<10} {'wall us/call':>13} {'extra':>8} {'CPU us/call':>12} {'extra':>8}")
    for c in CONFIGS:
        print(f"  {c:<10} {wall[c]:13.1f} {wall[c] - wall['untraced']:+8.1f} {cpu[c]:12.1f} "
              f"{cpu[c] - cpu['untraced']:+8.1f}")
    amplification = (f"{c} {(wall[c] - wall['untraced']) / max(cpu[c] - cpu['untraced'], 1e-9):.2f}" for c in CONFIGS[1:])
    print("wall extra / CPU extra: " + ", ".join(amplification))


if __name__ == "__main__":
    main()
