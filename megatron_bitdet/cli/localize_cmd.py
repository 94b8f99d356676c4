"""`bitdet localize RUN_A RUN_B`: first op whose inputs match but outputs differ (exit 0 / 1 / 2)."""
from __future__ import annotations

import json
import sys

from megatron_bitdet.analysis.localize import FALSE_ALARMS, MATCH, LocalizeConfig, localize_traces


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser(
        "localize", help=summary, description=summary + ".",
        epilog="Both run directories need traces/ (train with tracing on inside the suspect window). "
               "Exit 0: no mismatch; 1: mismatch found; 2: unusable input (missing, foreign or torn trace).",
    )
    p.add_argument("run_a", metavar="RUN_A", help="run directory with traces/")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--traces-only", action="store_true",
                   help="use only traces/ (the only mode today; kept for the automatic ladder)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--workers", type=int, default=0, help="parallel processes (default: one per CPU)")
    p.add_argument("--history", type=int, default=LocalizeConfig.history,
                   help="recent events kept per rank to trace a differing input back to its producer")
    p.set_defaults(func=run)


def _print_table(result) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    bad = [f for f in result.per_rank if f.classification != MATCH]
    if not bad:
        console.print(f"[green]no mismatch[/] in {result.events_compared} events over {result.ranks_compared} ranks")
    else:
        table = Table(title=f"first mismatch per rank ({len(bad)} of {result.ranks_compared} ranks)")
        for col in ("rank", "step", "phase", "module", "op", "classification", "detail"):
            table.add_column(col)
        for f in bad:
            style = "yellow" if f.classification in FALSE_ALARMS else None
            table.add_row(str(f.rank), str(f.step), f.phase or "", f.module or "", f.op or "",
                          f.classification, f.detail, style=style)
        console.print(table)
        c = result.culprit
        console.print(f"[bold]culprit:[/] rank {c['rank']} {c['classification']} at {c['event_id']}: {c['evidence']}")
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {w}")


def run(args) -> int:
    result = localize_traces(args.run_a, args.run_b, LocalizeConfig(workers=args.workers, history=args.history))
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_table(result)
    return 1 if result.mismatch else 0
