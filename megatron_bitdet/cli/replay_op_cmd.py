"""`bitdet replay-op DIR [DIR_B]`: replay a captured op occurrence in a fresh process and name its
mechanism (the kernel rung of `bitdet localize`, on its own)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

EXAMPLES = """examples:
  bitdet replay-op runs/a/ladder/kernel runs/b/ladder/kernel     # both runs' captures of one occurrence
  bitdet replay-op runs/a/ladder/kernel/captures/rank_00000.capture.pt --repeats 50 --threads 1,2,4

DIR: a capture file, or a run directory holding captures/rank_XXXXX.capture.pt (--rank picks one).
Exit 0: replayed (the verdict names the mechanism); 2: unusable input."""


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser("replay-op", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture_a", metavar="DIR", help="capture file or run directory with captures/")
    p.add_argument("capture_b", metavar="DIR_B", nargs="?", help="the other run's capture of the same occurrence")
    p.add_argument("--rank", type=int, help="which rank's capture (default: the only one)")
    p.add_argument("--repeats", type=int, default=20, help="replays per configuration (default 20)")
    p.add_argument("--threads", metavar="LIST", help="thread counts to try, e.g. 1,2,4 (default 1, recorded, CPUs)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    p.set_defaults(func=run)


def _resolve(path: str, rank) -> Path:
    from megatron_bitdet.errors import BitdetInputError
    from megatron_bitdet.rundir import capture_path

    p = Path(path)
    if p.is_file():
        return p
    if rank is not None:
        return capture_path(p, rank)
    where = capture_path(p, 0).parent
    found = sorted(where.glob("rank_*.capture.pt")) if where.is_dir() else []
    if len(found) != 1:
        raise BitdetInputError(f"{p}: {'no capture' if not found else f'{len(found)} captures'} under "
                               f"{where}; pass a capture file or --rank")
    return found[0]


def run(args) -> int:
    from megatron_bitdet.trace.options import parse_ranks
    from megatron_bitdet.analysis.kernel_replay import replay_op

    threads = parse_ranks(args.threads) if args.threads else None
    a = _resolve(args.capture_a, args.rank)
    b = _resolve(args.capture_b, args.rank) if args.capture_b else None
    verdict = replay_op(a, b, repeats=args.repeats, threads=threads)
    if args.json:
        print(json.dumps(verdict.to_json(), indent=1))
        return 0
    print(f"{verdict.event_id} on rank {verdict.rank}")
    for c in verdict.configs:
        extra = f"  error: {c['error']}" if c["error"] else ""
        print(f"  {c['label']:<34} {c['distinct']:>3} distinct in {c['repeats']:>3} repeats{extra}")
    for e in verdict.evidence:
        print(f"  {e}")
    print(f"verdict: {verdict.verdict}")
    return 0
