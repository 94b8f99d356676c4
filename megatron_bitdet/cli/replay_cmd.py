"""`bitdet replay`: re-run a step of a finished run bitwise from its checkpoint and take the step apart.

Resumes from the newest complete checkpoint that leaves --context steps before K, runs to K under the
run's manifest and verifies every replayed step's fingerprint against the original's (every rank, bit
for bit); at the first step that differs it stops and names the cause from the manifests. Verified, it
ranks the modules (every layer, every MoE expert) by how far step K's statistics depart from the steps
before it: max |x|, RMS and non-finite values of outputs and output gradients, share of the gradient
norm, router load. --counterfactual replays K with one change instead (each verified up to K-1).
A Megatron-LM run is replayed from its own checkpoints (its line's --save), its line re-run with --load,
--ckpt-step and --exit-interval K; its steps are compared afterwards (no stop at a first difference).
Exit: 0 reproduced, 1 the replay differs from the original, 2 unusable input."""
from __future__ import annotations

import argparse
import json
import math

from megatron_bitdet.cli.train_cmd import add_launcher_arg

EXAMPLES = """examples:
  bitdet replay runs/spike --step 5
  bitdet replay runs/spike --step 5 --counterfactual zero-expert:2.1 --counterfactual skip-microbatch:0
  bitdet replay runs/spike --step 5 --counterfactual prev-params:decoder.layers.2.mlp.experts
  bitdet replay runs/spike determinism.threads=1 --step 5      # does the thread count change the bits?
  bitdet replay runs/dp4 --step 5 --nproc 1     # a dp_invariant run's step on one rank

changes: skip-microbatch:M[@RANK] (micro-batch M of the step contributes nothing: loss mask zero),
         zero-expert:LAYER.EXPERT (that expert's router probability is zero at K),
         prev-params:MODULE (the module computes K with the params it had at the start of K-1)"""


def register(subparsers, summary):
    p = subparsers.add_parser("replay", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="a run directory with checkpoints (bitdet train, or bitdet megatron-lm with --save)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="recipe overrides for the replay, right after RUN_DIR (the replay's scope then differs)")
    p.add_argument("--step", type=int, required=True, metavar="K", help="the step to replay")
    p.add_argument("--context", type=int, default=2, metavar="C",
                   help="steps before K to replay as the baseline of the ranking (default 2)")
    p.add_argument("--checkpoints", metavar="DIR",
                   help="checkpoint root (default RUN_DIR/checkpoints; a Megatron-LM run's: its line's --save)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="replay on N ranks instead of the run's: another data-parallel size (the checkpoint "
                        "reshards); needs a run of determinism.reductions=dp_invariant")
    p.add_argument("--out", metavar="DIR", help="replay directory (default RUN_DIR/replay/step_K...)")
    p.add_argument("--counterfactual", action="append", default=[], metavar="CHANGE",
                   help="replay K with one change (repeatable: one replay each)")
    p.add_argument("--dump", action="store_true",
                   help="then replay once more saving the top module's inputs, outputs and output gradients at K "
                        "(OUT/dump/MODULE.rank_R.pt, torch.load(..., weights_only=True))")
    p.add_argument("--top", type=int, default=8, metavar="N", help="modules to print (default 8)")
    p.add_argument("--json", action="store_true", help="print the result(s) as JSON")
    p.set_defaults(func=run)
    add_launcher_arg(p)


def _fmt(v) -> str:
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)


def _print_verification(console, r) -> None:
    where = f"checkpoint iteration {r.checkpoint}" if r.checkpoint else "the start (no checkpoint before)"
    if r.verdict == "diverged":
        d = r.first_difference
        console.print(f"replay of {r.run_dir} from {where}: DIFFERS at step {d['step']} on rank(s) {d['ranks']} "
                      f"({', '.join(d['metrics'][:4])}); stopped there", markup=False, soft_wrap=True)
        console.print(f"cause: {r.cause}", markup=False, soft_wrap=True)
        return
    steps = r.verified
    span = f"{steps[0]}-{steps[-1]}" if steps else "none"
    console.print(f"replay of {r.run_dir} from {where}: steps {span} bitwise equal to the original "
                  f"(every rank, every metric and digest)", markup=False, soft_wrap=True)
    if r.loss:
        losses = ", ".join(f"step {s} {_fmt(v)}" for s, v in sorted(r.loss.items(), key=lambda kv: int(kv[0])))
        where = ""
        if r.previous_range and r.step in r.loss:
            lo, hi = r.previous_range
            now = r.loss[r.step]
            where = f" ({'above' if now > hi else 'below' if now < lo else 'within'} the previous range " \
                    f"{_fmt(lo)} .. {_fmt(hi)})"
        console.print(f"lm loss: {losses}{where}", markup=False, soft_wrap=True)
    for m in r.scope_differences:
        console.print(f"  note: scope differs in {m['key']} (original {m['a']!r}, replay {m['b']!r}) yet the bits "
                      "match", markup=False, soft_wrap=True)


def _print_ranking(console, r, top: int) -> None:
    from rich.table import Table

    if r.note:
        console.print(r.note, markup=False, soft_wrap=True)
        return
    prev = [s for s in r.replayed if s < r.step]
    table = Table(title=f"step {r.step} against steps {prev[0]}-{prev[-1]}: modules by departure (top {top})")
    for col in ("module", "rank", "score", "by", f"at {r.step}", "previous range"):
        table.add_column(col)
    for d in r.ranking[:top]:
        lo, hi = d["previous"]
        table.add_row(d["module"], str(d["rank"]), _fmt(d["score"]), d["by"], _fmt(d["value"]),
                      f"{_fmt(lo)} .. {_fmt(hi)}")
    console.print(table)
    for router, by_step in r.routers.items():
        now = by_step.get(r.step) or by_step.get(str(r.step))
        console.print(f"router load {router} (tokens per expert): step {r.step} {now}; "
                      + ", ".join(f"step {s} {v}" for s, v in by_step.items() if int(s) != r.step), markup=False, soft_wrap=True)


def _print_counterfactuals(console, results) -> None:
    from rich.table import Table

    from megatron_bitdet.workflows.replay import describe_change

    table = Table(title="counterfactual replays")
    for col in ("change at K", "verified", "lm loss at K", "original", "previous range", "within range"):
        table.add_column(col)
    for r in results:
        if r.verdict == "diverged":
            d = r.first_difference
            table.add_row(describe_change(r.change), f"DIFFERS at {d['step']}", "-", "-", "-", "-")
            continue
        lo, hi = r.previous_range or (None, None)
        table.add_row(describe_change(r.change), f"{r.verified[0]}-{r.verified[-1]}" if r.verified else "-",
                      _fmt(r.loss.get(r.step)), _fmt(r.original_loss),
                      f"{_fmt(lo)} .. {_fmt(hi)}" if hi is not None else "-",
                      {True: "yes", False: "no", None: "-"}[r.within_range])
    console.print(table)
    for r in results:
        if r.verdict == "diverged":
            console.print(f"{describe_change(r.change)}: cause: {r.cause}", markup=False, soft_wrap=True)


def run(args) -> int:
    from rich.console import Console

    from megatron_bitdet.workflows.replay import parse_change, replay

    changes = [parse_change(c) for c in args.counterfactual]  # all checked before any launch
    common = dict(out=args.out, context=args.context, overrides=args.overrides, checkpoints=args.checkpoints,
                  nproc=args.nproc)
    if args.dump and changes:
        from megatron_bitdet.errors import BitdetInputError

        raise BitdetInputError("--dump goes with the plain replay, not with --counterfactual")
    if args.out and len(changes) > 1:
        from megatron_bitdet.errors import BitdetInputError

        raise BitdetInputError("--out with several --counterfactual: each replay needs its own directory")
    results = [replay(args.run_dir, args.step, change=c, **common) for c in changes] if changes else \
        [replay(args.run_dir, args.step, dump=args.dump, **common)]
    if args.json:
        print(json.dumps([r.to_json() for r in results] if changes else results[0].to_json(), indent=1))
    else:
        console = Console(width=160)
        if changes:
            _print_counterfactuals(console, results)
        else:
            _print_verification(console, results[0])
            if results[0].verdict == "reproduced":
                _print_ranking(console, results[0], args.top)
            if results[0].dump:
                console.print(f"dumped {results[0].ranking[0]['module']} at step {args.step}: {results[0].dump}",
                              markup=False, soft_wrap=True)
    return max(r.exit_code for r in results)
