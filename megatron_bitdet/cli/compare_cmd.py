"""`bitdet compare RUN_A RUN_B`: exit 0 bitwise match, 1 diverged or incomplete, 2 unusable input."""
from __future__ import annotations

import json
import sys

from megatron_bitdet.analysis.compare import CompareResult, MetricDiff, compare_runs
from megatron_bitdet.trace.options import parse_ranks
from megatron_bitdet.errors import BitdetInputError


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser(
        "compare", help=summary, description=summary + ".",
        epilog="Exit 0: every step of both runs (or of --steps) compared, bit for bit equal; 1: diverged, "
               "or incomplete (a step is in one run only, or missing from both inside the steps run: the runs "
               "were not compared in full); 2: unusable "
               "input, including no step in common. A truncated final line (a crash mid-write) is unusable "
               "unless --allow-truncated, which compares the steps before it (then incomplete at best).",
    )
    p.add_argument("run_a", metavar="RUN_A", help="run directory (with fingerprints/) or TensorBoard log dir")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--force", action="store_true", help="compare even if the validation scopes differ")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--metrics", type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
                   help="comma-separated metric names (digests as digest:<name>); default: all")
    p.add_argument("--ranks", type=str, help="ranks to compare, e.g. 0,2,4-7; default: all")
    p.add_argument("--steps", type=str, help="steps to compare, e.g. 3-8 (each must be in both runs); default: all")
    p.add_argument("--format", dest="fmt", choices=("auto", "bitdet", "tensorboard"), default="auto")
    p.add_argument("--allow-truncated", action="store_true",
                   help="ignore a truncated final line instead of refusing the file")
    p.add_argument("--max-details", type=int, default=20, help="differing values listed at the first divergent step")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        result = compare_runs(
            args.run_a, args.run_b, force=args.force, metrics=args.metrics, fmt=args.fmt,
            ranks=parse_ranks(args.ranks) if args.ranks else None, allow_truncated=args.allow_truncated,
            steps=parse_ranks(args.steps, "--steps") if args.steps else None,
        )
    except BitdetInputError as exc:
        if not args.json:
            raise
        print(json.dumps(CompareResult.unusable(args.run_a, args.run_b, exc).to_json(), indent=2))
        print(f"bitdet compare: error: {exc}", file=sys.stderr)
        return 2
    for w in result.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(json.dumps(result.to_json(), indent=2) if args.json else format_result(result, args.max_details))
    return result.exit_code


def format_result(result: CompareResult, max_details: int = 20) -> str:
    """Human-readable verdict: what was compared, or where and by how many bits it first differs."""
    what = (f"{result.steps_compared} steps x {len(result.ranks_compared)} ranks x "
            f"{len(result.metrics_compared)} metrics + {len(result.digests_compared)} digests")
    lines = []
    div = result.first_divergence
    if div is None and result.verdict == "incomplete":
        why = "steps are missing" if result.lengths_differ else f"{', '.join(result.truncated)} cut short"
        lines.append(f"INCOMPLETE: {what} bit for bit equal, but {why}: not a match")
    elif div is None:
        lines.append(f"MATCH: {what}, bit for bit")
    else:
        later = [s for s in result.diverged_steps if s > div.step]
        after = sum(1 for s in result.per_step if s.step > div.step)
        lines += [
            f"DIVERGED at step {div.step} (compared {what})",
            f"  metrics differing: {', '.join(div.metrics)}",
            f"  ranks differing:   {', '.join(map(str, div.ranks))}",
        ]
        lines += [_detail(d) for d in div.details[:max_details]]
        if len(div.details) > max_details:
            lines.append(f"  ... {len(div.details) - max_details} more (use --json for all)")
        lines.append(f"  after step {div.step}: {len(later)} of {after} later steps differ"
                     + (f" (last: step {later[-1]})" if later else "") + _max_ulps(result))
    if result.lengths_differ:
        lines.append(f"steps missing: {result.missing_steps()} (compared the common steps)")
    if result.scope_mismatches:  # the verdict holds only across the scopes compared: say which differ
        keys = ", ".join(str(m["key"]) for m in result.scope_mismatches)
        lines.append(f"FORCED: the validation scopes differ ({keys}); compared anyway (--force)")
    return "\n".join(lines)


def _detail(d: MetricDiff) -> str:
    head = f"  {d.name:<14} rank {d.rank}  "
    if d.ulp is not None:
        return (f"{head}{d.a_value:.10g} vs {d.b_value:.10g}  ({d.ulp} ulp, bit {d.first_bit})\n"
                f"  {'':<14} exact   {d.a_value!r} vs {d.b_value!r}  [{d.a} vs {d.b}]")
    return f"{head}{d.a} vs {d.b}  ({d.note})"


def _max_ulps(result: CompareResult) -> str:
    worst: dict[str, int] = {}
    for s in result.per_step:
        for name, ulp in s.max_ulp.items():
            if ulp:
                worst[name] = max(ulp, worst.get(name, 0))
    return ("; max ulp: " + ", ".join(f"{k} {v}" for k, v in sorted(worst.items()))) if worst else ""
