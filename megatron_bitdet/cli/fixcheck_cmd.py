"""`bitdet fixcheck`: validate a fix with paired runs (exit 0 only when the original pair diverges and
the fixed pair matches bitwise), classify it, and measure its tax."""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_bitdet.cli.train_cmd import add_launcher_arg, add_run_args, load_run_recipe

EXAMPLES = """examples:
  bitdet fixcheck --recipe recipes/nemotron_h_tiny.yaml --model-provider examples.planted_nondeterminism:index_put_provider \\
      determinism.mode=false model.seq_length=256 training.micro_batch_size=4 training.iterations=2 \\
      --fix determinism.mode=true --out runs/fixcheck
  bitdet fixcheck --recipe R --fix determinism.threads=1 --runs 3 --no-tax
  bitdet fixcheck --recipe R --model-provider my:broken --fix-provider my:fixed --reuse-original --out runs/fc
  bitdet fixcheck --megatron-lm $MEGATRON_LM_PATH/pretrain_gpt.py --nproc 2 --out runs/fc \
      --fix-flags=--no-rope-fusion --fix-drop cross-entropy-loss-fusion -- <launch line>

out directory: original/run_i, fixed/run_i (run directories), tax/ (the interleaved measurement),
fixcheck.json (the whole result). Exit 0: original diverges, fixed matches; 1: otherwise; 2: bad input."""


def register(subparsers, summary: str) -> None:
    p = subparsers.add_parser("fixcheck", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, recipe_required=False)
    p.add_argument("--megatron-lm", metavar="SCRIPT",
                   help="check a fix of a Megatron-LM launch line: SCRIPT with the line after -- (the fix as "
                        "--fix-flags / --fix-drop / --fix-env; no tax measured)")
    p.add_argument("--fix-flags", action="append", default=[], metavar="FLAGS",
                   help="with --megatron-lm: flags the fix adds to the line, e.g. --fix-flags=--no-rope-fusion or "
                        "--fix-flags \"--spec MODULE NAME\" (a flag already on the line takes these values; repeatable)")
    p.add_argument("--fix-drop", action="append", default=[], metavar="FLAG",
                   help="with --megatron-lm: a flag the fix drops from the line, with its values: its name with or "
                        "without the dashes (--fix-drop rope-fusion, --fix-drop=--rope-fusion; repeatable)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override the fix consists of (repeatable)")
    p.add_argument("--fix-provider", metavar="MODULE:FUNC", help="the fix is another model provider")
    p.add_argument("--fix-env", action="append", default=[], metavar="NAME=VALUE",
                   help="env variable set for the fixed runs (repeatable)")
    p.add_argument("--runs", type=int, default=2, metavar="N", help="runs per configuration (default 2: a pair)")
    p.add_argument("--out", metavar="DIR", help="where the runs go (default runs/fixcheck/<recipe name>)")
    p.add_argument("--levels", default="op", metavar="LIST",
                   help="ladder rungs used to localize the original's divergence (default op; then the kernel rung)")
    p.add_argument("--no-localize", action="store_true", help="do not localize the original's divergence")
    p.add_argument("--no-tax", action="store_true", help="do not measure the fix's tax")
    p.add_argument("--tax-rounds", type=int, default=10, help="interleaved timed rounds (default 10)")
    p.add_argument("--tax-warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--reuse-original", action="store_true",
                   help="keep original runs already in OUT made from the same recipe and provider")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)
    add_launcher_arg(p)


def _parse_env(items) -> dict:
    from megatron_bitdet.errors import BitdetInputError

    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise BitdetInputError(f"--fix-env {item!r}: expected NAME=VALUE")
        out[name] = value
    return out


def _run_line(args, levels) -> object:
    """--megatron-lm: the fix in the line's language (flags to add / drop, env)."""
    from megatron_bitdet.cli.verify_resume_cmd import launch_line_after_dashes
    from megatron_bitdet.errors import BitdetInputError
    from megatron_bitdet.workflows.fixcheck import Fix, fixcheck_line, flag_groups

    given = [f for f, on in (("--recipe", args.recipe), ("--model-provider", args.model_provider),
                             ("--deterministic-mode", args.deterministic_mode), ("--no-tax", args.no_tax),
                             ("--reuse-original", args.reuse_original)) if on]
    if given:
        raise BitdetInputError(f"{', '.join(given)} does not apply with --megatron-lm (the launch line after -- "
                               "is the configuration; no tax is measured there)")
    line = launch_line_after_dashes(args)
    if not line:
        raise BitdetInputError("--megatron-lm needs the launch line after --")
    drops = [w if w.startswith("--") else f"--{w}" for text in args.fix_drop for w in text.split()]
    fix = Fix(env=_parse_env(args.fix_env), overrides=list(args.fix), provider=args.fix_provider,
              add_flags=[g for text in args.fix_flags for g in flag_groups(text, "--fix-flags")], drop_flags=drops)
    return fixcheck_line(args.megatron_lm, line, fix, nproc=args.nproc, runs=args.runs, localize=not args.no_localize,
                         levels=levels, out_dir=args.out or os.path.join("runs", "fixcheck",
                                                                         os.path.basename(args.megatron_lm)))


def run(args) -> int:
    from megatron_bitdet.errors import BitdetInputError
    from megatron_bitdet.model.builder import load_model_provider
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.workflows.fixcheck import Fix, fixcheck

    levels = tuple(filter(None, (lv.strip() for lv in args.levels.split(","))))
    if args.megatron_lm:
        return _report(_run_line(args, levels), args.json)
    if args.fix_flags or args.fix_drop:
        raise BitdetInputError("--fix-flags / --fix-drop change a Megatron-LM launch line: give --megatron-lm SCRIPT "
                               "and the line after --")
    if not args.recipe:
        raise BitdetInputError("--recipe is required (or --megatron-lm SCRIPT -- <launch line>)")
    recipe = load_run_recipe(args)
    fix = Fix(overrides=list(args.fix), provider=args.fix_provider, env=_parse_env(args.fix_env))
    fixed = load_recipe(args.recipe, [*args.overrides, *(["determinism.mode=true"] if args.deterministic_mode else []),
                                      *fix.overrides])
    sys.path.insert(0, os.getcwd())
    for provider in (args.model_provider, args.fix_provider):
        if provider:
            load_model_provider(provider)  # fail here, before any rank starts
    result = fixcheck(recipe, fixed, fix, nproc=args.nproc, provider=args.model_provider,
                      out_dir=args.out or os.path.join("runs", "fixcheck", recipe.name), runs=args.runs,
                      localize=not args.no_localize, levels=levels, tax=not args.no_tax,
                      tax_rounds=args.tax_rounds, tax_warmup=args.tax_warmup, reuse_original=args.reuse_original)
    return _report(result, args.json)


def _report(result, as_json: bool) -> int:
    if as_json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print_result(result)
    return result.exit_code


def _pairs(label: str, v) -> str:
    rows = []
    for p in v.pairs:
        if p["verdict"] == "diverged":
            rows.append(f"{label}: {os.path.basename(p['a'])} vs {os.path.basename(p['b'])} DIVERGED at step "
                        f"{p['step']} on rank(s) {p['ranks']} ({', '.join(p['metrics'][:4])}"
                        f"{', ...' if len(p['metrics']) > 4 else ''})")
        else:
            rows.append(f"{label}: {os.path.basename(p['a'])} vs {os.path.basename(p['b'])} "
                        f"{'MATCH' if p['complete'] else 'INCOMPLETE'} over {p['steps_compared']} of {v.steps} steps")
    return "\n".join(rows)


def print_result(result) -> None:
    from megatron_bitdet.workflows.ladder import describe

    print(_pairs("original", result.original))
    print(_pairs("fixed   ", result.fixed))
    loc = result.localize or {}
    if loc.get("culprit"):
        print(f"localized: {describe(loc['culprit'])}")
    if loc.get("kernel"):
        print(f"kernel:    {loc['kernel']['verdict']}")
    for c in result.changes:
        print(f"change:    {c['change']}: {c['kind']} — {c['what']}")
    kind = {"corrects": "corrects the implementation", "works_around": "works around it",
            "unclassified": "unclassified (see the changes)", "no change": "changes nothing"}[result.kind]
    print(f"fix:       {kind}")
    if result.tax:
        t = result.tax
        print(f"tax:       {t['tax_percent']:+.2f}% (paired {t['paired_tax_percent']:+.2f}%): fixed "
              f"{t['fixed_ms']:.1f} ms vs original {t['original_ms']:.1f} ms per step, {t['rounds']} interleaved "
              f"rounds on {t['nproc']} ranks x {t['threads']} threads")
    for n in result.notes:
        print(f"note:      {n}")
    verdict = ("original diverges, fixed matches" if result.ok else
               "NOT VALIDATED: " + ("the original pair does not diverge" if not result.original.diverged
                                    else "the fixed pair does not match"))
    print(f"{verdict}: {result.headline()}")
