"""Fingerprint throughput vs memcpy, and the per-step state digest's share of a ~100 ms step.

Run: python benchmarks/bench_fingerprint.py   (about 30 s on 2 CPU cores)
Goals: pos64 (position-sensitive, torch integer ops on the device) >= 0.5x memcpy;
state_digest of a ~1M-parameter model <= 0.3% of a 100 ms step.
"""
from __future__ import annotations

import statistics
import time

import torch

from megatron_bitdet.fingerprint.tensor import exact_digest, pos_digest, state_digest, xor_digest


def best_s(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    torch.set_num_threads(2)
    x = torch.randn(64 << 20)  # 256 MiB float32
    gib = x.numel() * 4 / (1 << 30)
    dst = torch.empty_like(x)
    rows = {
        "memcpy (copy_ into preallocated)": lambda: dst.copy_(x),
        "clone (allocating memcpy)": lambda: x.clone(),
        "pos64 digest (torch int ops)": lambda: pos_digest(x),
        "torch.hash_tensor (XOR)": lambda: xor_digest(x),
        "xxh3_128 exact bytes": lambda: exact_digest(x),
    }
    speeds = {name: gib / best_s(fn) for name, fn in rows.items()}
    print(f"256 MiB float32, {torch.get_num_threads()} threads")
    for name, s in speeds.items():
        print(f"  {name:36s} {s:6.2f} GiB/s")
    pos = speeds["pos64 digest (torch int ops)"]
    print(f"pos64 / memcpy = {pos / speeds['memcpy (copy_ into preallocated)']:.2f}x   "
          f"pos64 / clone = {pos / speeds['clone (allocating memcpy)']:.2f}x   (goal >= 0.5x)")

    params = [(f"p{i}", torch.randn(256, 256)) for i in range(16)]  # 1.05M parameters
    samples = []
    for _ in range(50):
        t0 = time.perf_counter()
        state_digest(params)
        samples.append(time.perf_counter() - t0)
    ms = statistics.median(samples) * 1e3
    nbytes = sum(p.nbytes for _, p in params)
    print(f"state_digest, {sum(p.numel() for _, p in params) / 1e6:.2f}M params: {ms:.3f} ms "
          f"({nbytes / ms / 1e6:.1f} GB/s; what a training step's fingerprint costs: bench_fingerprint_overhead.py)")


if __name__ == "__main__":
    main()
