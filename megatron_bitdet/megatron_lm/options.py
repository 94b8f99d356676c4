"""bitdet's options on a Megatron-LM launch line: added to Megatron's parser (chained into the script's
``extra_args_provider``) and pre-parsed by the entry point before the script is imported."""
from __future__ import annotations

import argparse
import os

DEFAULT_RUN_DIR = "bitdet_run"


def steps_list(value: str) -> str:
    """``K1,K2``: iterations (>= 0) after which a snapshot is taken; kept as given (the hooks split it)."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected iterations K1,K2 (integers >= 0), got {value!r}")
    return value


def selection(value: str) -> str:
    """``all`` or a selection file that exists (verify-resume's second pass writes it before launching)."""
    if value != "all" and not os.path.isfile(value):
        raise argparse.ArgumentTypeError(f"expected all or a selection file, got {value!r} (no such file)")
    return value


def add_entry_args(parser):
    """bitdet's arguments on Megatron's parser (and on the entry's own pre-parser): the plugin's
    ``add_args``, where the run directory goes, and ``bitdet train``'s tracing flags."""
    from megatron_bitdet.enforce.megatron import add_args
    from megatron_bitdet.trace.options import add_trace_args

    add_args(parser)
    group = parser.add_argument_group(title="bitdet run", description="run directory, snapshots")
    group.add_argument("--run-dir", default=None, metavar="DIR",
                       help="manifest, fingerprints, snapshots, traces (default: ./bitdet_run)")
    group.add_argument("--snapshot-at", default=None, metavar="K1,K2", type=steps_list,
                       help="live-state snapshots (digests) as step K+1 begins (bitdet verify-resume)")
    group.add_argument("--snapshot-full", default=None, metavar="all|FILE", type=selection,
                       help="snapshots also keep these tensors in full: all, or a selection file (verify-resume's "
                            "second pass)")
    group.add_argument("--accept-skipped-restore", action="store_true",
                       help="accept a resume that skips restored state on purpose (--no-load-optim, --no-load-rng, "
                            "--finetune, ...; rule resume_skips_restore), recorded in the manifest as an opt-out")
    add_trace_args(parser)
    return parser


def preparse(argv: list[str]):
    """bitdet's options out of a Megatron launch line (Megatron parses them again, chained). Imports
    no torch: the entry point calls it before the canonical environment is in place."""
    from megatron_bitdet.errors import BitdetInputError

    parser = add_entry_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False))
    try:
        known, _ = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:  # a bad value of one of bitdet's options: exit 2, before any rank
        raise BitdetInputError(str(exc)) from None
    return known
