"""`bitdet megatron-lm`: run Megatron-LM's own pretrain_gpt.py / pretrain_mamba.py unmodified under bitdet."""
from __future__ import annotations

import argparse

EXAMPLES = """examples:
  bitdet megatron-lm --nproc 2 --run-dir runs/m $MEGATRON_LM_PATH/pretrain_mamba.py --deterministic-mode \\
      --spec megatron_bitdet.megatron_lm.specs local_mamba_stack_spec ... <Megatron args>
  bitdet megatron-lm --check $MEGATRON_LM_PATH/pretrain_gpt.py --deterministic-mode <a production launch line>
  bitdet megatron-lm --nproc 2 --run-dir runs/t $MEGATRON_LM_PATH/pretrain_mamba.py <Megatron args> \\
      --trace op --trace-steps 1-1          # twice; then: bitdet localize runs/t runs/t2
  torchrun --nproc-per-node 8 -m megatron_bitdet.megatron_lm PATH/pretrain_mamba.py --deterministic-mode \\
      --recipe R.yaml --run-dir runs/gpu <Megatron args>

--check judges the launch line as Megatron validates it, without training (exit 2 listing every violation;
3 when the rules pass but this machine cannot run it: the section "will not run on this machine" names
each flag to add or drop; 0 when clean); flags for kernels that are not installed here are judged, not
imported. A launch refuses before any rank starts (exit 2), listing both. bitdet's own options may appear
among the Megatron args: --recipe, --bitdet-override, --run-dir, --snapshot-at, --accept-skipped-restore (a
resume that skips restored state on purpose: --no-load-optim, --no-load-rng, --finetune, ... are refused on a
line with --load without it), and bitdet train's
tracing flags (--trace LEVEL --trace-steps A-B --trace-ranks LIST --trace-hash H --trace-capture R:EVENT).
`bitdet localize` compares two traced runs, or re-launches two fingerprint-only runs from their manifests
traced (the ladder; run it where the runs were launched).
run directory: manifest.json, fingerprints/rank_XXXXX.jsonl, logs/rank_XXXXX.log (as for `bitdet train`),
timings/rank_XXXXX.jsonl (each train_step's wall time: the tax of `bitdet prove --megatron-lm`),
traces/rank_XXXXX.trace.jsonl (with --trace)"""


def register(subparsers, summary):
    p = subparsers.add_parser("megatron-lm", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=1, help="ranks on this machine (default 1)")
    p.add_argument("--run-dir", default=None, help="manifest, fingerprints and logs (default ./bitdet_run)")
    p.add_argument("--check", action="store_true", help="judge the launch line only (dry run; no training)")
    p.add_argument("script", help="the Megatron-LM script, e.g. $MEGATRON_LM_PATH/pretrain_mamba.py")
    p.add_argument("megatron_args", nargs=argparse.REMAINDER, help="the script's arguments, unchanged")
    p.set_defaults(func=run)


def run(args) -> int:
    from megatron_bitdet.megatron_lm import entry

    if args.check:
        argv = list(args.megatron_args) + (["--run-dir", args.run_dir] if args.run_dir else [])
        return entry.main(["--check", args.script, *argv], world_size=args.nproc)
    from megatron_bitdet.megatron_lm.launch import launch_line

    return launch_line(args.script, args.megatron_args, nproc=args.nproc, run_dir=args.run_dir)
