"""The headline determinism tax: the default recipe vs the fastest nondeterministic recipe, one session.

    .venv/bin/python benchmarks/bench_tax.py [--rounds 30] [--warmup 5] [--nproc 2] [overrides...]

Prints the table of `bitdet tax`, the tax (median-based and paired), which baseline won and the op
group that grew the most. Goal: <= 1% on the tiny hybrid (upstream's mode costs +4.7% here, almost all
torch's NaN-fill of uninitialized memory, which the recipe turns off).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from rich.console import Console

    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.workflows.tax import measure_tax, print_tax

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=str(Path(__file__).resolve().parents[1] / "recipes/nemotron_h_tiny.yaml"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = tempfile.mkdtemp(prefix="bench_tax_")
    result = measure_tax(load_recipe(args.recipe, args.overrides), nproc=args.nproc, rounds=args.rounds,
                         warmup=args.warmup, out_dir=out)
    print_tax(result, Console())
    print(f"raw: {out}/tax.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
