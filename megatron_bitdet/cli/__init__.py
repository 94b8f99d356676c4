"""The `bitdet` console command.

Each subcommand lives in its own module under ``megatron_bitdet.cli`` and exposes
``register(subparsers)`` (adds its parser and sets ``func``) — the registry below is
the only place that lists them.  ``func(args)`` returns the exit code.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from megatron_bitdet.compat.versions import require_supported
from megatron_bitdet.errors import BitdetError

# module name -> one-line summary (kept here so `bitdet --help` needs no heavy imports)
SUBCOMMANDS = {
    "recipe": "validate / show YAML recipes",
    "enforce": "apply --deterministic-mode for a recipe and print the environment and manifest",
    "train": "pretrain the hybrid Nemotron on megatron-core with per-step fingerprints",
    "compare": "compare two runs' fingerprints step by step (exit 0 match, 1 diverged, 2 bad input)",
    "check": "compare one run's data-parallel replicas with each other (exit 0 consistent, 1 disagree, 2 bad input)",
    "verify_resume": "check bitwise checkpoint resume against an uninterrupted run",
    "tax": "measure the determinism tax against the fastest nondeterministic recipe",
    "prove": "the main job: independent runs, resumed runs, comparisons, tax and report",
    "localize": "find the first op whose inputs match but outputs differ between two runs",
    "megatron_lm": "run Megatron-LM's own pretrain_gpt.py / pretrain_mamba.py unmodified under bitdet",
    "replay": "replay a step bitwise from a checkpoint (verified) and rank its modules; counterfactuals",
    "replay_op": "replay a captured op occurrence in isolation and name its nondeterministic mechanism",
    "fixcheck": "validate a fix with paired runs: the original pair diverges, the fixed pair matches",
    "doctor": "rank the known causes of a divergence with their evidence and the next command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bitdet",
        description="Bitwise-deterministic pretraining for Megatron Core: enforce, prove, localize, measure.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in SUBCOMMANDS.items():
        importlib.import_module(f"megatron_bitdet.cli.{name}_cmd").register(sub, summary)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        require_supported()  # every subcommand reads runs or drives megatron-core of the supported range
        return int(args.func(args) or 0)
    except BitdetError as exc:
        print(f"bitdet {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
