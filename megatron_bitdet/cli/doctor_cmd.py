"""`bitdet doctor A B`: ranked likely causes of a divergence, with their evidence and the next command."""
from __future__ import annotations

import argparse
import json

EXAMPLES = """examples:
  bitdet doctor runs/a runs/b                       # compare, the saved ladder result or the ladder itself
  bitdet doctor runs/a runs/b --offline --json      # rank from what exists; never re-run training
  bitdet doctor runs/verify_resume/nemotron_h_tiny  # a verify-resume --out directory

Causes come from the catalog of known sources (catalog/known_sources.yaml, package data megatron_bitdet.catalog).
Exit 0: nothing to diagnose (the runs match, the resume holds); 1: a divergence was diagnosed, or the runs
were not compared in full (incomplete); 2: bad input."""


def register(subparsers, summary: str) -> None:
    from megatron_bitdet.workflows.ladder import LadderConfig

    p = subparsers.add_parser("doctor", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", metavar="A", help="run directory, or a verify-resume --out directory (alone)")
    p.add_argument("run_b", metavar="B", nargs="?", help="the other run directory")
    p.add_argument("--offline", action="store_true", help="rank from existing results only: never re-run training")
    p.add_argument("--levels", default="semantic,module,op", metavar="LIST",
                   help="ladder rungs when the ladder has to run (default %(default)s)")
    p.add_argument("--no-kernel", action="store_true", help="ladder without the kernel rung")
    p.add_argument("--repeats", type=int, default=LadderConfig.repeats, help="kernel rung replays per configuration")
    p.add_argument("--top", type=int, default=5, help="causes listed (default 5)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from megatron_bitdet.workflows.ladder import LadderConfig
    from megatron_bitdet.workflows.doctor import doctor

    levels = tuple(filter(None, (lv.strip() for lv in args.levels.split(","))))
    report = doctor(args.run_a, args.run_b, offline=args.offline,
                    ladder=LadderConfig(levels=levels, kernel=not args.no_kernel, repeats=args.repeats))
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print(format_report(report, args.top))
    return 1 if report.diagnosis.causes or report.verdict not in ("match", "resume holds") else 0


def format_report(report, top: int = 5) -> str:
    d = report.diagnosis
    lines = [f"verdict: {report.verdict}", *(f"evidence from {s}" for s in report.sources)]
    lines += [f"note: {n}" for n in d.notes]
    if d.causes:
        lines.append("likely causes, best first:")
    for i, c in enumerate(d.causes[:top], 1):
        lines.append(f"{i}. [{c.id}] {c.title} (score {c.score})")
        lines += [f"     evidence: {e}" for e in c.evidence]
        lines.append(f"     mechanism: {c.mechanism}")
        lines.append(f"     fix: {c.fix['change']} ({c.fix['kind'].replace('_', ' ')})")
    if d.next:
        lines.append(f"next: {d.next}")
    return "\n".join(lines)
