"""`bitdet check RUN`: one run's data-parallel replicas compared with each other, step by step."""
from __future__ import annotations

import json
import sys

from megatron_bitdet.analysis.replicas import check_run, format_result


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser(
        "check", help=summary, description=summary + ".",
        epilog="Every replica digests its slice of each replicated DDP buffer and, each step, one chunk of the "
               "next replica's slice (fingerprint format v2): within 4 steps every replicated byte is digested "
               "by two replicas at one step. Exit 0: every such pair equal; 1: replicas disagree (listed by step, "
               "buffer, byte range and ranks: silent data corruption or a fault); 2: unusable input (a v1 run, "
               "a run without replicas, a malformed line).",
    )
    p.add_argument("run", metavar="RUN", help="run directory (with fingerprints/)")
    p.add_argument("--json", action="store_true", help="print the result, with each step's combined digests, as JSON")
    p.add_argument("--allow-truncated", action="store_true",
                   help="ignore a truncated final line instead of refusing the file")
    p.add_argument("--max-details", type=int, default=20, help="disagreements listed")
    p.set_defaults(func=run)


def run(args) -> int:
    result = check_run(args.run, allow_truncated=args.allow_truncated)
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_result(result, args.max_details))
    return result.exit_code
