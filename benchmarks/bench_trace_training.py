"""Tracing overhead inside real training: the default recipe's step untraced vs module- and op-level
tracing (goals: module <= 1.2x, op <= 2x), and tracing configured but outside its window (goal 1.0x:
nothing installed). Each configuration is one 2-rank launch; the per-step times megatron's console
reports for the last rank are compared as medians over steps after warm-up, in one run of this script.

    .venv/bin/python benchmarks/bench_trace_training.py [--iterations 8]
"""
from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path

from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.trace import TraceConfig
from megatron_bitdet.train.run import RunOptions, launch_training

ROOT = Path(__file__).resolve().parents[1]
_ELAPSED = re.compile(r"iteration\s+(\d+)/.*elapsed time per iteration \(ms\): ([\d.]+)")


def step_ms(run_dir: Path, nproc: int, warmup: int) -> float:
    text = (run_dir / "logs" / f"rank_{nproc - 1:05d}.log").read_text()
    times = [float(ms) for it, ms in _ELAPSED.findall(text) if int(it) > warmup]
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    recipe = load_recipe(ROOT / "recipes" / "nemotron_h_tiny.yaml", [f"training.iterations={args.iterations}"])
    traced = [args.warmup + 1, args.iterations]
    configs = {
        "untraced": None,
        "outside window": TraceConfig("op", (args.iterations + 1,) * 2),
        "module": TraceConfig("module", tuple(traced)),
        "op": TraceConfig("op", tuple(traced)),
    }
    ms = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, trace in configs.items():
            run = Path(tmp) / name.replace(" ", "_")
            if launch_training(recipe, RunOptions(nproc=2, run_dir=run, trace=trace)) != 0:
                raise SystemExit(f"{name}: training failed, see {run}/logs")
            ms[name] = step_ms(run, 2, args.warmup)
    base = ms["untraced"]
    print(f"\nstep time (median of steps {args.warmup + 1}-{args.iterations}, 2 ranks, last rank):")
    for name, goal in (("untraced", None), ("outside window", 1.0), ("module", 1.2), ("op", 2.0)):
        ratio = ms[name] / base
        mark = "" if goal is None else f"  (goal <= {goal:.1f}x: {'ok' if ratio <= goal * 1.05 else 'MISSED'})"
        print(f"  {name:<15} {ms[name]:8.1f} ms  x{ratio:.2f}{mark}")


if __name__ == "__main__":
    main()
