"""Tracing overhead on a small transformer-ish training step, per level, measured in one run.

Run: python benchmarks/bench_trace.py   (about a minute on 2 CPU cores)
Configurations are interleaved per round; prints median step ms and the ratio traced/untraced.
Goals: op level <= 2x, module level <= 1.2x.
"""
from __future__ import annotations

import statistics
import tempfile
import time

import torch

from megatron_bitdet.trace import Tracer


class Layer(torch.nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.attn = torch.nn.MultiheadAttention(h, 4, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))

    def forward(self, x):
        y = self.norm(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm(x))


def make(h=256, layers=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Layer(h) for _ in range(layers)])
    return model, torch.optim.Adam(model.parameters()), torch.randn(8, 128, h)


def step(model, opt, data, tracer, n):
    with tracer.step(n):
        with tracer.phase("forward"):
            loss = model(data).square().mean()
        with tracer.phase("backward"):
            loss.backward()
        with tracer.phase("optimizer"):
            opt.step()
            opt.zero_grad()


def main(rounds: int = 8) -> None:
    torch.set_num_threads(2)
    tmp = tempfile.mkdtemp()
    model, opt, data = make()
    tracers = {"off": Tracer(tmp + "/off", 0, 1, steps=(0, -1))}  # empty window: installs nothing
    for level in ("semantic", "module", "op"):
        tracers[level] = Tracer(f"{tmp}/{level}", 0, 1, level=level)
        tracers[level].attach(model)
    times = {k: [] for k in tracers}
    for r in range(rounds + 1):
        for name, tr in tracers.items():
            t0 = time.perf_counter()
            step(model, opt, data, tr, r + 1)
            if r:  # round 0 is warm-up
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["off"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:9s} {med * 1e3:8.1f} ms/step   x{med / base:.2f} vs untraced")
    with open(f"{tmp}/op/traces/rank_00000.trace.jsonl") as f:
        print(f"op-level events per step: {(sum(1 for _ in f) - 1) // (rounds + 1)}")
    for tr in tracers.values():
        tr.close()


if __name__ == "__main__":
    main()
