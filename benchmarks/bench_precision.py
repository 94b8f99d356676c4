"""Step time of fp32 / bf16 mixed precision / emulated FP8 / emulated NVFP4 on the default recipe's
shapes, one session.

    .venv/bin/python benchmarks/bench_precision.py [--rounds 20] [--warmup 3] [--nproc 2] [overrides...]

One launch (the tax's side-by-side worker): every rank builds the four configurations and alternates
their steps on the same batches (A B C, C B A, ...), all in deterministic mode, so machine drift and
the launch cancel out. Prints median / p10 / p90 step time per precision and the ratios to fp32,
paired per round. On CPU bf16 and emulated FP8 are *slower* than fp32 (no bf16 / fp8 GEMM units; FP8
adds quantize-dequantize and one amax all-reduce per operand; NVFP4 quantizes five operands per linear,
transforms two with the Hadamard matrix and draws a uniform per gradient element for stochastic
rounding): the figures measure the determinism machinery's cost of low precision here, not GPU speed-ups.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PRECISIONS = {
    "fp32": [],
    "bf16": ["model.params_dtype=bfloat16"],
    "fp8 (emulated, delayed)": ["model.params_dtype=bfloat16", "model.fp8.recipe=delayed"],
    "fp4 (emulated, nvfp4)": ["model.params_dtype=bfloat16", "model.fp4.recipe=nvfp4"],
}


def main() -> int:
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.train.launch import launch
    from megatron_bitdet.train.run import check_layout, child_env

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(ROOT / "recipes/nemotron_h_tiny.yaml"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    steps = [f"training.iterations={args.warmup + args.rounds + 1}"]
    recipes = {n: load_recipe(args.recipe, [*args.overrides, *steps, *o]) for n, o in PRECISIONS.items()}
    base = recipes["fp32"]
    check_layout(base, args.nproc)
    out = Path(tempfile.mkdtemp(prefix="bench_precision_"))
    sides = [{"name": n, "recipe": r.to_dict(), "deterministic": True} for n, r in recipes.items()]
    rc = launch("megatron_bitdet.workflows.tax_worker:tax_worker", args.nproc,
                {"recipe": base.to_dict(), "sides": sides, "rounds": args.rounds, "warmup": args.warmup,
                 "profile_steps": 1, "out_path": str(out / "raw.json")},
                run_dir=out, env=child_env(base), console_rank=-1)
    if rc != 0:
        print(f"benchmark failed (exit {rc}); logs: {out / 'logs'}", file=sys.stderr)
        return 1
    data = json.loads((out / "raw.json").read_text())
    # a step takes as long as its slowest rank
    ms = {s["name"]: np.array([max(r[i]["step_s"][k] for r in data["ranks"]) * 1000
                               for k in range(args.rounds)]) for i, s in enumerate(sides)}
    print(f"{base.name}: {args.rounds} interleaved rounds on {data['world_size']} ranks x {data['threads']} threads "
          f"(raw: {out / 'raw.json'})")
    print(f"{'precision':26s} {'median ms':>10s} {'p10':>8s} {'p90':>8s} {'vs fp32 (paired median)':>24s}")
    for name, xs in ms.items():
        ratio = float(np.median(xs / ms["fp32"]))
        print(f"{name:26s} {np.median(xs):10.1f} {np.percentile(xs, 10):8.1f} {np.percentile(xs, 90):8.1f} "
              f"{ratio:23.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
