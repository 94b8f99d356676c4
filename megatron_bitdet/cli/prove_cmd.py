"""`bitdet prove`: two independent runs, a run resumed from checkpoints, the comparisons, the tax, a report.

Exit 0: every guarantee holds; 1: a guarantee is broken; 2: unusable input."""
from __future__ import annotations

import argparse
import os
import sys

from megatron_bitdet.cli.train_cmd import add_run_args, load_run_recipe

EXAMPLES = """examples:
  bitdet prove --recipe nemotron_h_tiny --out runs/demo          # what `make demo` runs
  bitdet prove --recipe nemotron_h_tiny --out runs/p --resume-at 3,6 training.iterations=9
  bitdet prove --recipe R --out runs/p --no-tax

OUT: run_a/ (reference, with live-state snapshots), run_b/, resume/segment_*/, tax/, report.html"""


def register(subparsers, summary):
    p = subparsers.add_parser("prove", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--out", default="runs/prove", metavar="DIR", help="output directory (default runs/prove)")
    p.add_argument("--resume-at", metavar="K1,K2",
                   help="iterations to stop and restore at (default: iterations/3 and 2*iterations/3)")
    p.add_argument("--no-tax", action="store_true", help="skip the determinism tax measurement")
    p.add_argument("--tax-rounds", type=int, default=4, help="timed tax rounds (default 4; `bitdet tax` for more)")
    p.add_argument("--json", action="store_true", help="also write OUT/prove.json")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from rich.console import Console

    from megatron_bitdet.workflows.prove import ProveConfig, prove, verdict_table
    from megatron_bitdet.workflows.resume import parse_resume_at

    recipe = load_run_recipe(args)
    resume_at = parse_resume_at(args.resume_at) if args.resume_at else None
    if args.model_provider:
        sys.path.insert(0, os.getcwd())
    console = Console()
    result = prove(recipe, nproc=args.nproc, out_dir=args.out, resume_at=resume_at, model_provider=args.model_provider,
                   config=ProveConfig(tax=not args.no_tax, tax_rounds=args.tax_rounds), console=console)
    console.print(verdict_table(result))
    if args.json:
        payload = {"holds": result.holds, "verdicts": [v.__dict__ for v in result.verdicts],
                   "resume": result.resume.to_json(), "tax": json.loads(result.tax.to_json()) if result.tax else None,
                   "tax_error": result.tax_error, "stage_seconds": result.stage_seconds}
        with open(os.path.join(args.out, "prove.json"), "w") as f:
            json.dump(payload, f, indent=2)
    console.print(("[green]every guarantee holds" if result.holds else "[bold red]a guarantee is BROKEN")
                  + f" — report: {result.report_path}")
    return result.exit_code
