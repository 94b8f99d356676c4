"""`bitdet tax`: the deterministic recipe vs the fastest nondeterministic recipe, in one interleaved session."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from megatron_bitdet.cli.train_cmd import add_run_args, load_run_recipe

EXAMPLES = """examples:
  bitdet tax --recipe nemotron_h_tiny --nproc 2
  bitdet tax --recipe nemotron_h_tiny --rounds 40 --warmup 5 --json model.hidden_size=128

tax = (median deterministic step time / median baseline step time - 1) x 100%. The baseline is the
fastest of determinism.mode=false with each supported MoE expert implementation."""


def register(subparsers, summary):
    p = subparsers.add_parser("tax", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--rounds", type=int, default=20, help="timed rounds, one step per configuration (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps per configuration (op groups)")
    p.add_argument("--out", metavar="DIR", help="where tax.json and rank logs go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console

    from megatron_bitdet.workflows.tax import measure_tax, print_tax

    recipe = load_run_recipe(args)
    if args.model_provider:
        sys.path.insert(0, os.getcwd())
    out = args.out or tempfile.mkdtemp(prefix="bitdet_tax_")
    result = measure_tax(recipe, nproc=args.nproc, rounds=args.rounds, warmup=args.warmup, out_dir=out,
                         profile_steps=args.profile_steps, model_provider=args.model_provider)
    if args.json:
        print(result.to_json())
        return 0
    console = Console()
    print_tax(result, console)
    console.print(f"details: {out}/tax.json")
    return 0
