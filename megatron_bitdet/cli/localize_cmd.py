"""`bitdet localize RUN_A RUN_B`: first op whose inputs match but outputs differ (exit 0 / 1 / 2).

With traces/ in both runs they are compared directly; with fingerprints only, the automatic ladder
(workflows.ladder) re-runs both around the first divergent step with tracing on, level by level."""
from __future__ import annotations

import json
import sys

from pathlib import Path

from megatron_bitdet.analysis.diagnose import diagnose, facts_from_ladder
from megatron_bitdet.cli.train_cmd import add_launcher_arg
from megatron_bitdet.workflows.ladder import LadderConfig, describe, run_ladder
from megatron_bitdet.analysis.localize import FALSE_ALARMS, MATCH, LocalizeConfig, localize_traces
from megatron_bitdet.trace.format import LEVELS, trace_dir


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser(
        "localize", help=summary, description=summary + ".",
        epilog="Runs with traces/ are compared as they are; runs with fingerprints only go up the ladder: "
               "first divergent step from the fingerprints, then both runs re-launched from their manifests (a "
               "bitdet train run from its recipe, a Megatron-LM run from its script and launch line; run from the "
               "directory they were launched in) with tracing semantic -> module -> op in a "
               "window ending at that step, into RUN_X/ladder/<level>/, then the kernel rung: the culprit op "
               "captured in both re-runs (RUN_X/ladder/kernel/) and replayed in isolation. "
               "Exit 0: no mismatch; 1: mismatch found (also when the ladder could not reproduce it: "
               "intermittent); 2: unusable input (missing, foreign or torn trace, scope mismatch).",
    )
    p.add_argument("run_a", metavar="RUN_A", help="run directory with traces/")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--traces-only", action="store_true", help="use only traces/: never re-run training")
    p.add_argument("--levels", default=",".join(LEVELS), metavar="LIST",
                   help=f"ladder rungs, in order (default {','.join(LEVELS)})")
    p.add_argument("--context", type=int, default=LadderConfig.context, metavar="K",
                   help="ladder: steps traced before the first divergent one (default %(default)s)")
    p.add_argument("--no-kernel", action="store_true",
                   help="ladder: stop at the op rung (no capture re-run, no isolated replay of the culprit op)")
    p.add_argument("--repeats", type=int, default=LadderConfig.repeats, metavar="N",
                   help="kernel rung: replays of the captured op per configuration (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--workers", type=int, default=0, help="parallel processes (default: one per CPU)")
    p.add_argument("--history", type=int, default=LocalizeConfig.history,
                   help="recent events kept per rank to trace a differing input back to its producer")
    p.set_defaults(func=run)
    add_launcher_arg(p)


def _print_table(result) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    bad = [f for f in result.per_rank if f.classification != MATCH]
    ignored = sum(f.ignored for f in result.per_rank)
    note = f" ({ignored} differing records ignored: no effect on outputs, or uninitialized memory)" if ignored else ""
    if not bad:
        head = "[red]INCOMPLETE[/]: no mismatch" if result.incomplete else "[green]no mismatch[/]"
        console.print(f"{head} in {result.events_compared} events over {result.ranks_compared} ranks" + note)
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
        console.print(f"[bold]culprit:[/] rank {c['rank']} {c['classification']} at {c['event_id']}: {c['evidence']}"
                      + note)
        console.print(escape(diagnose(facts_from_ladder({"culprit": c})).headline()), highlight=False)
        if c["classification"] == "producer":
            console.print("kernel rung: comes with the ladder (localize on fingerprint-only runs re-runs them, "
                          "captures this op and replays it); `bitdet replay-op` replays a capture")
    for w in result.warnings:
        console.print(f"[yellow]warning:[/] {w}")


def _print_ladder(result) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(soft_wrap=True)  # one line per rung: greppable, copyable
    if not result.diverged:
        console.print(f"[green]{result.note}[/]")
        return
    console.print(f"fingerprints diverge first at step {result.first_step} on rank(s) {result.first_ranks} "
                  f"({', '.join(result.first_metrics)})")
    for r in result.rungs:
        found = describe(r.culprit) if r.culprit else "no mismatch"
        console.print(f"  {r.level:<8} steps {r.steps[0]}-{r.steps[1]} ranks {'all' if r.ranks is None else r.ranks}"
                      f" ({r.events_compared} events): {found}")
    if result.reproduced:
        console.print(f"[bold]culprit:[/] {escape(describe(result.culprit))}")
        if result.kernel:
            console.print(f"[bold]kernel:[/]  {escape(result.kernel['verdict'])}", highlight=False)
            for line in result.kernel.get("evidence", []):
                console.print(f"  {escape(line)}", highlight=False)
    else:
        console.print(f"[yellow]{escape(result.note)}[/]")
    console.print(escape(diagnose(facts_from_ladder(result.to_json())).headline()), highlight=False)


def run(args) -> int:
    local = LocalizeConfig(workers=args.workers, history=args.history)
    if not args.traces_only and not (trace_dir(args.run_a).is_dir() and trace_dir(args.run_b).is_dir()):
        levels = tuple(filter(None, (lv.strip() for lv in args.levels.split(","))))
        ladder = run_ladder(Path(args.run_a), Path(args.run_b),
                            LadderConfig(levels=levels, context=args.context, localize=local,
                                         kernel=not args.no_kernel, repeats=args.repeats))
        if args.json:
            json.dump(ladder.to_json(), sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            _print_ladder(ladder)
        return ladder.exit_code
    result = localize_traces(args.run_a, args.run_b, local)
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_table(result)
    if result.incomplete and not result.mismatch:
        print("bitdet localize: error: no mismatch in what was compared, but not a match:\n  "
              + "\n  ".join(result.incomplete), file=sys.stderr)
    return result.exit_code
