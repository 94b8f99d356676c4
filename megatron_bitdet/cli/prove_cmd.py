"""`bitdet prove`: two independent runs, a run resumed from checkpoints, the comparisons, the tax, a report.

Exit 0: every guarantee holds; 1: a guarantee is broken; 2: unusable input."""
from __future__ import annotations

import argparse
import os
import sys

from megatron_bitdet.cli.train_cmd import add_launcher_arg, add_run_args, load_run_recipe
from megatron_bitdet.cli.verify_resume_cmd import add_megatron_lm_args, launch_line_after_dashes

EXAMPLES = """examples:
  bitdet prove --recipe nemotron_h_tiny --out runs/demo          # what `make demo` runs
  bitdet prove --recipe nemotron_h_tiny --out runs/p --resume-at 3,6 training.iterations=9
  bitdet prove --recipe R --out runs/p --no-tax
  bitdet prove --megatron-lm $MEGATRON_LM_PATH/pretrain_mamba.py --nproc 2 --resume-at 2 --out runs/mp \\
      -- --deterministic-mode --train-iters 3 ...   # a Megatron-LM launch line, run unmodified

OUT: run_a/ (reference, with live-state snapshots), run_b/, resume/segment_*/, tax/, report.html
With --megatron-lm the tax is run A and run B against one more launch of the same line without
--deterministic-mode (tax/baseline/): per-step train_step times, sequential launches, warm-up excluded."""


def register(subparsers, summary):
    p = subparsers.add_parser("prove", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, recipe_required=False)
    add_megatron_lm_args(p, "prove a Megatron-LM launch line (--recipe, when given, is passed on it as the entry "
                            "point's --recipe)")
    p.add_argument("--out", default="runs/prove", metavar="DIR", help="output directory (default runs/prove)")
    p.add_argument("--resume-at", metavar="K1,K2",
                   help="iterations to stop and restore at (default: iterations/3 and 2*iterations/3)")
    p.add_argument("--no-tax", action="store_true", help="skip the determinism tax measurement")
    p.add_argument("--tax-rounds", type=int, default=None,
                   help="timed tax rounds (default 4; `bitdet tax` for more; not with --megatron-lm)")
    p.add_argument("--json", action="store_true", help="also write OUT/prove.json")
    p.set_defaults(func=run)
    add_launcher_arg(p)


def _runs(args):
    """What launches the runs: a bitdet recipe, or a Megatron-LM launch line."""
    from megatron_bitdet.errors import BitdetInputError

    if args.megatron_lm:
        from megatron_bitdet.workflows.megatron_prove import MegatronRuns

        for flag, given in (("--deterministic-mode", args.deterministic_mode),
                            ("--model-provider", args.model_provider), ("--tax-rounds", args.tax_rounds is not None)):
            if given:
                raise BitdetInputError(f"{flag} does not apply with --megatron-lm (the launch line after -- "
                                       f"defines the run; put --deterministic-mode there)")
        return MegatronRuns(args.megatron_lm, launch_line_after_dashes(args), nproc=args.nproc, recipe=args.recipe,
                            skip_restore=args.skip_restore)
    if not args.recipe:
        raise BitdetInputError("--recipe is required (or --megatron-lm SCRIPT -- <launch line>)")
    if args.skip_restore:
        raise BitdetInputError("--skip-restore needs --megatron-lm (bitdet's loop: verify-resume --fault-skip-restore)")
    from megatron_bitdet.workflows.prove import RecipeRuns

    if args.model_provider:
        sys.path.insert(0, os.getcwd())
    return RecipeRuns(load_run_recipe(args), nproc=args.nproc, model_provider=args.model_provider)


def run(args) -> int:
    import json

    from rich.console import Console

    from megatron_bitdet.workflows.prove import ProveConfig, prove, verdict_table
    from megatron_bitdet.workflows.resume import parse_resume_at

    runs = _runs(args)
    resume_at = parse_resume_at(args.resume_at) if args.resume_at else None
    console = Console()
    result = prove(runs, out_dir=args.out, resume_at=resume_at, console=console,
                   config=ProveConfig(tax=not args.no_tax, tax_rounds=args.tax_rounds or ProveConfig.tax_rounds))
    console.print(verdict_table(result))
    if args.json:
        payload = {"holds": result.holds, "verdicts": [v.__dict__ for v in result.verdicts],
                   "resume": result.resume.to_json(), "tax": json.loads(result.tax.to_json()) if result.tax else None,
                   "tax_error": result.tax_error, "replicas_unchecked": result.replicas_unchecked,
                   "stage_seconds": result.stage_seconds}
        with open(os.path.join(args.out, "prove.json"), "w") as f:
            json.dump(payload, f, indent=2)
    console.print(("[green]every guarantee holds" if result.holds else "[bold red]a guarantee is BROKEN")
                  + f" — report: {result.report_path}")
    return result.exit_code
