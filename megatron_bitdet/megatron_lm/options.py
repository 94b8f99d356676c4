"""bitdet's options on a Megatron-LM launch line: added to Megatron's parser (chained into the script's
``extra_args_provider``) and pre-parsed by the entry point before the script is imported."""
from __future__ import annotations

import argparse

from megatron_bitdet.errors import BitdetInputError

DEFAULT_RUN_DIR = "bitdet_run"


def add_entry_args(parser):
    """bitdet's arguments on Megatron's parser (and on the entry's own pre-parser): the plugin's
    ``add_args`` plus where the run directory goes (tracing options are recognized, and refused)."""
    from megatron_bitdet.enforce.megatron import add_args

    add_args(parser)
    group = parser.add_argument_group(title="bitdet run", description="run directory, snapshots")
    group.add_argument("--run-dir", default=None, metavar="DIR",
                       help="manifest, fingerprints, snapshots (default: ./bitdet_run)")
    group.add_argument("--snapshot-at", default=None, metavar="K1,K2",
                       help="live-state snapshots as step K+1 begins (bitdet verify-resume)")
    group.add_argument("--trace", default=None, metavar="LEVEL", help="refused for now (use bitdet train)")
    group.add_argument("--trace-steps", default=None, metavar="A-B", help="refused for now")
    group.add_argument("--trace-ranks", default=None, metavar="LIST", help="refused for now")
    return parser


def preparse(argv: list[str]):
    """bitdet's options out of a Megatron launch line (Megatron parses them again, chained)."""
    parser = add_entry_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    known, _ = parser.parse_known_args(argv)
    if known.trace or known.trace_steps or known.trace_ranks:
        raise BitdetInputError("--trace is not wired into Megatron-LM's loop yet: trace and localize with "
                               "`bitdet train` (bitdet compare / verify-resume work on Megatron-LM runs)")
    return known
