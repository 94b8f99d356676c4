"""The determinism tax side by side: bitdet's deterministic recipe vs upstream's deterministic mode vs
the fastest nondeterministic recipe, same model and batches, ONE interleaved launch per shape.

    .venv/bin/python benchmarks/bench_tax_vs_upstream.py [--rounds 20] [--warmup 3] [--nproc 2] [--shapes default,large]
        [--decompose]

Sides (built side by side on every rank by the tax worker, steps alternated A B C .., .. C B A):
* bitdet      -- the recipe as bitdet runs it (kernel swaps, its torch flags; fill_uninitialized_memory
                 as the recipe says, off by default);
* upstream    -- megatron ``deterministic_mode`` + upstream's deterministic mode as the installed
                 megatron-core runs it (``compat.upstream_determinism``: 0.19's
                 ``megatron/training/determinism.py`` ``apply_determinism_to_args`` before each of its
                 steps; before 0.19 the ``torch.use_deterministic_algorithms(True)`` of Megatron-LM's
                 validate_args), torch's default ``fill_uninitialized_memory=True``, megatron's own
                 experts and aux loss, no swaps;
* baseline    -- the fastest nondeterministic candidate (determinism off, each expert implementation);
* with ``--decompose``, bitdet with one of its differences from upstream undone at a time (megatron's
  own experts; megatron's aux-loss reduction; torch's NaN-fill on): where bitdet vs upstream comes from,
  each probe paired against both.
Shapes: the default recipe (hidden 64, seq 64) and a larger one (hidden 256, seq 256). Layout: the
recipe's (2 ranks, EP 2) by default; ``--nproc 1 --set parallel.expert=1`` measures one rank's compute
without the ranks' waits for each other, which on a 2-core machine dominate the noise (docs/benchmarks.md).
Prints p10/p50/p90 step times, paired ratios (median over rounds of side/baseline and bitdet/upstream) each
with its 95% bootstrap interval (``benchmarks.intervals``), the goal's verdict (bitdet vs upstream <= 0:
"ok" only when the whole interval is at or below 0) with the per-round log ratio's standard deviation, and
the per-op-group profile of bitdet vs upstream.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.intervals import median_interval, paired_ratios, verdict  # noqa: E402  (the root on the path first)
from benchmarks.shapes import SHAPES  # noqa: E402

GOAL = 1.0  # bitdet's step time at most upstream's deterministic mode's (a paired ratio)
CALLS_SHOWN = 12


def sides_for(recipe, decompose: bool = False) -> list[dict]:
    """bitdet, upstream, the ``--decompose`` probes (deterministic), then the nondeterministic candidates."""
    from megatron_bitdet.workflows.tax import candidates

    sides = candidates(recipe)
    bitdet, nondet = sides[0], sides[1:]
    bitdet["name"] = "bitdet"
    moe = "E" in recipe.model.hybrid_pattern
    up = recipe.to_dict()
    if moe:
        up["model"]["moe"]["expert_impl"] = "sequential"  # megatron's own experts (TE's grouped GEMM on GPU)
    upstream = {"name": "upstream", "recipe": up, "deterministic": True, "swaps": False, "upstream_mode": True,
                "without_patches": ["moe_aux_loss"], "fill_uninitialized_memory": True}
    probes = []
    if decompose:
        if moe:
            probes += [{**bitdet, "name": "bitdet, megatron experts", "recipe": up},
                       {**bitdet, "name": "bitdet, megatron aux loss", "without_patches": ["moe_aux_loss"]}]
        probes.append({**bitdet, "name": "bitdet, NaN-fill on", "fill_uninitialized_memory": True})
    return [bitdet, upstream, *probes, *nondet]


def paired(a, b) -> tuple[float, tuple[float, float]]:
    """The paired median of a / b over rounds and its 95% bootstrap interval."""
    ratios = paired_ratios(a, b)
    return statistics.median(ratios), median_interval(ratios)


def pct(ratio: float, interval: tuple[float, float]) -> str:
    return f"{(ratio - 1) * 100:+6.1f}% [{(interval[0] - 1) * 100:+.1f}%, {(interval[1] - 1) * 100:+.1f}%]"


def report(shape: str, stats) -> None:
    from megatron_bitdet.workflows.tax_worker import op_group

    bitdet, upstream, *rest = stats
    probes, nondet = [s for s in rest if s.deterministic], [s for s in rest if not s.deterministic]
    base = min(nondet, key=lambda s: s.median_ms)
    rounds = len(bitdet.step_ms)
    print(f"\n== {shape}: {rounds} interleaved rounds; baseline = {base.name} "
          f"(of {', '.join(f'{c.name} {c.median_ms:.1f} ms' for c in nondet)})")
    print(f"  {'side':<22} {'p10 ms':>8} {'p50 ms':>8} {'p90 ms':>8}   paired vs baseline [95% interval]")
    for s in (bitdet, upstream, base):
        print(f"  {s.name:<22} {s.p10_ms:8.1f} {s.median_ms:8.1f} {s.p90_ms:8.1f}   "
              f"{pct(*paired(s.step_ms, base.step_ms))}")
    ratio, interval = paired(bitdet.step_ms, upstream.step_ms)
    spread = statistics.stdev(math.log(r) for r in paired_ratios(bitdet.step_ms, upstream.step_ms)) if rounds > 1 else 0.0
    print(f"  bitdet vs upstream (paired): {pct(ratio, interval)}  "
          f"(goal <= +0.0%: {verdict(ratio, interval, GOAL, rounds)}; per-round log-ratio sd {spread:.3f})")
    for s in probes:
        print(f"  probe {s.name:<28} vs upstream {pct(*paired(s.step_ms, upstream.step_ms))}   "
              f"vs bitdet {pct(*paired(s.step_ms, bitdet.step_ms))}")
    a, b = bitdet, upstream
    groups = sorted(set(a.op_groups_ms) | set(b.op_groups_ms),
                    key=lambda g: -abs(a.op_groups_ms.get(g, 0.0) - b.op_groups_ms.get(g, 0.0)))
    print(f"  op groups, {a.name} vs {b.name} (profiled self time, ms/step):")
    for g in groups:
        x, y = a.op_groups_ms.get(g, 0.0), b.op_groups_ms.get(g, 0.0)
        print(f"    {g:<22} {x:8.2f} {y:8.2f} {x - y:+8.2f}")
    ops = sorted(set(a.op_calls) | set(b.op_calls), key=lambda k: -abs(a.op_calls.get(k, 0) - b.op_calls.get(k, 0)))
    print(f"  calls per step that differ most, {a.name} vs {b.name} (rank 0; counts do not move with load):")
    for k in ops[:CALLS_SHOWN]:
        x, y = a.op_calls.get(k, 0), b.op_calls.get(k, 0)
        if x != y:
            print(f"    {k[:40]:<40} [{op_group(k)}] {x:8.0f} {y:8.0f} {x - y:+8.0f}")


def main() -> int:
    import os

    from megatron_bitdet.compat import upstream_determinism
    from megatron_bitdet.workflows.tax import TaxConfig, run_sides, with_measured_batches
    from megatron_bitdet.recipe import load_recipe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default=str(ROOT / "recipes/nemotron_h_tiny.yaml"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--shapes", default="default,large")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every side, after the shape's (e.g. determinism.threads=1)")
    p.add_argument("--decompose", action="store_true",
                   help="also run bitdet with each of its differences from upstream undone (where the gap comes from)")
    args = p.parse_args()
    cfg = TaxConfig(rounds=args.rounds, warmup=args.warmup, profile_steps=2)
    print(f"upstream: {upstream_determinism.source()}; load average before: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for shape in args.shapes.split(","):
        recipe = with_measured_batches(load_recipe(args.recipe, SHAPES[shape] + args.set), cfg)
        out = tempfile.mkdtemp(prefix=f"bench_tax_upstream_{shape}_")
        stats, threads, _ = run_sides(recipe, sides_for(recipe, args.decompose), nproc=args.nproc, config=cfg,
                                      out_dir=out)
        m = recipe.model
        print(f"\n[{shape}] hidden {m.hidden_size}, seq {m.seq_length}, {args.nproc} ranks x {threads} threads; "
              f"rank logs: {out}/logs")
        report(shape, stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
