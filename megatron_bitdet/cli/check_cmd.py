"""`bitdet check RUN`: one run's data-parallel replicas compared with each other, step by step."""
from __future__ import annotations

import json
import sys

from megatron_bitdet.analysis.replicas import check_run, format_result


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser(
        "check", help=summary, description=summary + ".",
        epilog="At step s every data-parallel replica digests the same chunk of each replicated region (its slice "
               "owner as part of its slice): chunk s mod (D x 4) of D replicas x 4 chunks, so within D x 4 steps every "
               "replica's copy of every replicated byte (params, reduced grads, main params, the optimizer's per-element "
               "state without the distributed optimizer) is compared with all the others' at one step (fingerprint "
               "format v3). Prints what was covered and what the layout leaves uncoverable (owned shards). Exit 0: "
               "every comparison equal and every rank's file complete; 1: replicas disagree (listed by step, buffer, "
               "byte range and the suspect replica: the one outside the majority, both of two), or INCOMPLETE (a rank's "
               "file stops early, or --allow-truncated cut one); 2: unusable input (a v1 run, a run without replicas, "
               "a rank of the manifest's world without its file, a malformed line).",
    )
    p.add_argument("run", metavar="RUN", help="run directory (with fingerprints/)")
    p.add_argument("--json", action="store_true", help="print the result, with each step's combined digests, as JSON")
    p.add_argument("--allow-truncated", action="store_true",
                   help="read a file up to a truncated final line instead of refusing it (then INCOMPLETE at best)")
    p.add_argument("--max-details", type=int, default=20, help="disagreements listed")
    p.set_defaults(func=run)


def run(args) -> int:
    result = check_run(args.run, allow_truncated=args.allow_truncated)
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_result(result, args.max_details))
    return result.exit_code
