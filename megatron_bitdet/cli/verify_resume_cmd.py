"""`bitdet verify-resume`: stop and restore at each K, check the live state and later outputs bitwise.

Exit 0: the resume holds (every restored component and every later output bit-identical to an
uninterrupted run); 1: broken (the component, rank, key and first divergent output step are
named); 2: unusable input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_bitdet.cli.train_cmd import add_run_args, load_run_recipe

EXAMPLES = """examples:
  bitdet verify-resume --recipe nemotron_h_tiny --resume-at 2,5
  bitdet verify-resume --recipe R --resume-at 4 --out runs/vr --json training.iterations=8

out directory: reference/ (uninterrupted run with live-state snapshots) and one run directory per
segment of the chain (segment_NN_<start>-<stop>/): each a fresh launch that restores the previous
segment's checkpoint. Segment directories are replaced on every invocation."""


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser("verify-resume", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--resume-at", required=True, metavar="K1,K2,...",
                   help="iterations to stop and restore at: strictly increasing, each in 1..iterations-1")
    p.add_argument("--out", metavar="DIR", help="where the runs go (default runs/verify_resume/<recipe name>)")
    p.add_argument("--reference", metavar="RUN_DIR",
                   help="reuse an uninterrupted run of the same recipe that snapshotted every resume step")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--fault-skip-restore", action="append", default=[], metavar="COMPONENT",
                   help="TEST ONLY, for demonstrating detection: every restore skips COMPONENT "
                        "(rng.python, rng.numpy, rng.torch_cpu, rng.tracker, rng.module, data, optimizer.exp_avg, scheduler; "
                        "compute_copy.rounding rebuilds the bf16 copy rounding toward zero; fp8.amax_history "
                        "leaves the FP8 scaling state fresh)")
    p.set_defaults(func=run)


def run(args) -> int:
    from megatron_bitdet.workflows.resume import check_resume_at, parse_resume_at, verify_resume

    recipe = load_run_recipe(args)
    resume_at = check_resume_at(parse_resume_at(args.resume_at), recipe.training.iterations)
    if args.model_provider:
        from megatron_bitdet.model.builder import load_model_provider

        sys.path.insert(0, os.getcwd())
        load_model_provider(args.model_provider)  # fail here, before any rank starts
    report = verify_resume(
        recipe, resume_at, nproc=args.nproc, out_dir=args.out or os.path.join("runs", "verify_resume", recipe.name),
        model_provider=args.model_provider, faults=args.fault_skip_restore, reference_dir=args.reference,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        from rich.console import Console

        console = Console()
        console.print(report.table())
        console.print(report.summary(), style="green" if report.holds else "bold red", highlight=False)
    return 0 if report.holds else 1
