"""`bitdet tax`: the deterministic recipe vs the fastest nondeterministic recipe, in one interleaved session."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from megatron_bitdet.cli.train_cmd import add_run_args, load_run_recipe

EXAMPLES = """examples:
  bitdet tax --recipe nemotron_h_tiny --nproc 2
  bitdet tax --recipe nemotron_h_tiny --rounds 40 --warmup 5 --json model.hidden_size=128

tax = (median deterministic step time / median baseline step time - 1) x 100%. The baseline is the
fastest of determinism.mode=false with each supported MoE expert implementation."""


def register(subparsers, summary):
    p = subparsers.add_parser("tax", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--rounds", type=int, default=20, help="timed rounds, one step per configuration (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--profile-steps", type=int, default=2, help="profiled steps per configuration (op groups)")
    p.add_argument("--out", metavar="DIR", help="where tax.json and rank logs go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def tax_table(result):
    """Rich table: one column per configuration, the baseline marked."""
    from rich.markup import escape
    from rich.table import Table

    sides = [result.deterministic, *result.candidates]
    table = Table(title=f"determinism tax: {result.tax_percent:+.2f}%  (paired {result.paired_tax_percent:+.2f}%)")
    table.add_column("")
    for s in sides:
        table.add_column(escape(s.name) + (" ◀ baseline" if s is result.baseline else ""), justify="right")
    rows = [
        ("step time median (ms)", lambda s: f"{s.median_ms:.2f}"),
        ("p10 – p90 (ms)", lambda s: f"{s.p10_ms:.1f} – {s.p90_ms:.1f}"),
        ("tokens/s", lambda s: f"{s.tokens_per_s:,.0f}"),
        ("comm time median (ms)", lambda s: f"{s.comm_ms:.2f}"),
        ("peak memory (MiB)", lambda s: f"{s.peak_memory_mib:.1f}"),
        ("torch deterministic algorithms", lambda s: "/".join(map(str, s.det_algorithms_enabled))),
    ]
    groups = sorted({g for s in sides for g in s.op_groups_ms})
    rows += [(f"  {g} (ms, profiled)", lambda s, g=g: f"{s.op_groups_ms.get(g, 0.0):.2f}") for g in groups]
    for label, fn in rows:
        table.add_row(label, *[fn(s) for s in sides])
    return table


def print_tax(result, console) -> None:
    """Table, notes and summary (names like ``baseline[grouped]`` escaped from rich markup)."""
    from rich.markup import escape

    console.print(tax_table(result))
    for note in result.notes:
        console.print(f"• {escape(note)}")
    console.print(escape(result.summary()))


def run(args) -> int:
    from rich.console import Console

    from megatron_bitdet.analysis.tax import measure_tax

    recipe = load_run_recipe(args)
    if args.model_provider:
        sys.path.insert(0, os.getcwd())
    out = args.out or tempfile.mkdtemp(prefix="bitdet_tax_")
    result = measure_tax(recipe, nproc=args.nproc, rounds=args.rounds, warmup=args.warmup, out_dir=out,
                         profile_steps=args.profile_steps, model_provider=args.model_provider)
    if args.json:
        print(result.to_json())
        return 0
    console = Console()
    print_tax(result, console)
    console.print(f"details: {out}/tax.json")
    return 0
