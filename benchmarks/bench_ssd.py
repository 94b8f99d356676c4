"""Pure-torch chunked SSD vs a step-by-step sequential scan, forward+backward, measured in one run.

Run: python benchmarks/bench_ssd.py   (well under a minute on 2 idle CPU cores)
Prints per size: median seconds of each, the ratio sequential/chunked, and tokens/s of both.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_bitdet.kernels.ssd import ssd_chunk_scan_combined


@dataclass(frozen=True)
class Size:
    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    chunk: int


SIZES = [Size(2, 128, 8, 32, 1, 32, 32), Size(1, 512, 8, 64, 2, 64, 128)]
REPEATS = 5


def sequential_scan(x, dt, A, B, C, D):
    """The obvious recurrence, one Python step per token (the baseline to beat)."""
    b, l, h, p = x.shape
    r = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(r, dim=2), C.repeat_interleave(r, dim=2)
    state = x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for t in range(l):
        state = torch.exp(dt[:, t] * A)[:, :, None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1))
    return torch.stack(ys, dim=1) + x * D[:, None]


def inputs(s: Size):
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g).requires_grad_(True)  # noqa: E731
    return dict(x=r(s.batch, s.seqlen, s.nheads, s.headdim), dt=r(s.batch, s.seqlen, s.nheads),
                A=(-torch.rand(s.nheads, generator=g) - 0.5).requires_grad_(True),
                B=r(s.batch, s.seqlen, s.ngroups, s.dstate), C=r(s.batch, s.seqlen, s.ngroups, s.dstate),
                D=r(s.nheads))


def fwd_bwd_seconds(fn, t):
    for v in t.values():
        v.grad = None
    start = time.perf_counter()
    fn(t).square().mean().backward()
    return time.perf_counter() - start


def main():
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32, fwd+bwd, interleaved, median of {REPEATS}")
    for s in SIZES:
        t = inputs(s)
        chunked = lambda t, s=s: ssd_chunk_scan_combined(t["x"], F.softplus(t["dt"]), t["A"], t["B"], t["C"], s.chunk, D=t["D"])  # noqa: E731
        seq = lambda t: sequential_scan(t["x"], F.softplus(t["dt"]), t["A"], t["B"], t["C"], t["D"])  # noqa: E731
        fwd_bwd_seconds(chunked, t)  # warm-up
        fwd_bwd_seconds(seq, t)
        pairs = [(fwd_bwd_seconds(chunked, t), fwd_bwd_seconds(seq, t)) for _ in range(REPEATS)]  # interleaved
        c, q = (statistics.median(col) for col in zip(*pairs))
        tokens = s.batch * s.seqlen
        print(f"{s}: chunked {c * 1e3:8.1f} ms ({tokens / c:9.0f} tok/s) | sequential {q * 1e3:8.1f} ms "
              f"({tokens / q:8.0f} tok/s) | sequential/chunked = {q / c:5.1f}x")


if __name__ == "__main__":
    main()
