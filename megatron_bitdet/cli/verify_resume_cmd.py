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

from megatron_bitdet.cli.train_cmd import add_launcher_arg, add_run_args, load_run_recipe

EXAMPLES = """examples:
  bitdet verify-resume --recipe nemotron_h_tiny --resume-at 2,5
  bitdet verify-resume --recipe R --resume-at 4 --out runs/vr --json training.iterations=8
  bitdet verify-resume --recipe R --nproc 4 --resume-nproc 2 --resume-at 2 \
      determinism.reductions=dp_invariant determinism.virtual_dp=4   # saved at DP 4, resumed at DP 2
  bitdet verify-resume --megatron-lm $MEGATRON_LM_PATH/pretrain_mamba.py --resume-at 2 --out runs/vr \
      -- --deterministic-mode --train-iters 4 ...   # Megatron-LM's own --save/--load checkpoints

out directory: reference/ (uninterrupted run with live-state snapshots: per-tensor digests) and one
run directory per segment of the chain (segment_NN_<start>-<stop>/): each a fresh launch that restores
the previous segment's checkpoint; second_pass_<K>/ where a restored tensor differed (both sides re-run
to K keeping just those tensors in full, for element counts). Replaced on every invocation."""


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser("verify-resume", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, recipe_required=False)
    add_megatron_lm_args(p, "verify Megatron-LM's own checkpoints")
    p.add_argument("--resume-at", required=True, metavar="K1,K2,...",
                   help="iterations to stop and restore at: strictly increasing, each in 1..iterations-1")
    p.add_argument("--out", metavar="DIR", help="where the runs go (default runs/verify_resume/<recipe name>)")
    p.add_argument("--reference", metavar="RUN_DIR",
                   help="reuse an uninterrupted run of the same recipe that snapshotted every resume step")
    p.add_argument("--resume-nproc", type=int, metavar="N",
                   help="run the resumed segments on N ranks (the reference and the first segment on --nproc): a "
                        "checkpoint resharded across data-parallel sizes; needs determinism.reductions=dp_invariant")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--full-snapshots", action="store_true",
                   help="every snapshot also keeps its tensors in full (snapshots/iter_K/rank_R.full.pt; the "
                        "state's size per rank and resume point). Default: per-tensor chunk digests only, and a "
                        "targeted second pass saves in full just the tensors that differ")
    p.add_argument("--fault-skip-restore", action="append", default=[], metavar="COMPONENT",
                   help="TEST ONLY, for demonstrating detection: every restore skips COMPONENT "
                        "(rng.python, rng.numpy, rng.torch_cpu, rng.tracker, rng.module, data, optimizer.exp_avg, scheduler; "
                        "compute_copy.rounding rebuilds the bf16 copy rounding toward zero; fp8.amax_history "
                        "leaves the FP8 scaling state fresh; fp4.sr_rng leaves the NVFP4 stochastic-rounding "
                        "generators as built, fp4.block_scales the weights' NVFP4 encodings fresh, "
                        "fp4.hadamard_signs re-draws the Hadamard signs)")
    p.set_defaults(func=run)
    add_launcher_arg(p)


def run(args) -> int:
    from megatron_bitdet.errors import BitdetInputError
    from megatron_bitdet.workflows.resume import check_resume_at, parse_resume_at, verify_resume

    if args.resume_nproc is not None and args.resume_nproc < 1:
        raise BitdetInputError(f"--resume-nproc {args.resume_nproc}: must be a positive number of ranks")
    if args.megatron_lm:
        from megatron_bitdet.workflows.megatron_resume import verify_megatron_resume

        report = verify_megatron_resume(
            args.megatron_lm, launch_line_after_dashes(args), parse_resume_at(args.resume_at), nproc=args.nproc,
            skip_restore=args.skip_restore,
            reference_dir=args.reference, full_snapshots=args.full_snapshots, resume_nproc=args.resume_nproc,
            out_dir=args.out or os.path.join("runs", "verify_resume", os.path.basename(args.megatron_lm)))
        return _print_report(report, args)
    if not args.recipe:
        raise BitdetInputError("--recipe is required (or --megatron-lm SCRIPT -- <launch line>)")
    recipe = load_run_recipe(args)
    resume_at = check_resume_at(parse_resume_at(args.resume_at), recipe.training.iterations)
    if args.model_provider:
        from megatron_bitdet.model.builder import load_model_provider

        sys.path.insert(0, os.getcwd())
        load_model_provider(args.model_provider)  # fail here, before any rank starts
    report = verify_resume(
        recipe, resume_at, nproc=args.nproc, out_dir=args.out or os.path.join("runs", "verify_resume", recipe.name),
        model_provider=args.model_provider, faults=args.fault_skip_restore, reference_dir=args.reference,
        full_snapshots=args.full_snapshots, resume_nproc=args.resume_nproc,
    )
    return _print_report(report, args)


def add_megatron_lm_args(p, purpose: str) -> None:
    """``--megatron-lm SCRIPT`` (the launch line after ``--``) and ``--skip-restore`` (verify-resume, prove)."""
    p.add_argument("--megatron-lm", metavar="SCRIPT",
                   help=f"{purpose}: SCRIPT (pretrain_gpt.py / pretrain_mamba.py) with the launch line after --, "
                        "e.g. -- --deterministic-mode --train-iters 4 ...")
    p.add_argument("--skip-restore", action="append", default=[], metavar="WHAT",
                   help="with --megatron-lm: pass Megatron-LM's own --no-load-rng (rng) or --no-load-optim "
                        "(optimizer) to every resumed segment, i.e. a restore deliberately skipped")


def launch_line_after_dashes(args) -> list:
    """The Megatron-LM launch line given after ``--`` (argparse leaves it among the positionals)."""
    return args.overrides[1:] if args.overrides[:1] == ["--"] else list(args.overrides)


def _print_report(report, args) -> int:
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        from rich.console import Console

        console = Console()
        console.print(report.table())
        console.print(report.summary(), style="green" if report.holds else "bold red", highlight=False)
        if not report.holds:
            from megatron_bitdet.analysis.diagnose import diagnose, facts_from_resume

            console.print(diagnose(facts_from_resume(report.to_json())).headline(), highlight=False, markup=False)
    return 0 if report.holds else 1
