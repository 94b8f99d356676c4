"""Judging a Megatron-LM launch line: the line parsed by the script's own parser, validated as Megatron
validates it (on a copy: ``validate``), read as the run's recipe and judged on what ``--spec`` will build
(the audit walks the spec as data: its experts class, its attention, what its Mamba mixers call) —
every violation at once, opt-outs honoured — together with what this machine cannot run (``machine``).

- ``check_launch``: ``--check`` prints the judgement (and the machine section) and exits 2 / 3 / 0; the
  manifest is written (``--run-dir``) whenever the rules pass.
- ``preflight``: before any rank starts (``bitdet megatron-lm --nproc``), every problem at once, exit 2.
- ``judge_line``: what both share with the ranks' own judgement at ``validate_args`` (``loop_hooks``),
  which then enforces and installs what was judged. Every refusal of a line comes in one report: Megatron's
  own (its message, or a bare assert's source line), the unsupported flags, the determinism violations (the
  recipe's rules and ``line_rules``), what this machine cannot run.
- ``parse_line``: the line parsed by the script's parser, refusing in one line (an unknown flag and the one
  meant, a bad value) instead of a usage dump and an exit, before any rank starts.

Nothing here wraps Megatron: ``loop_hooks`` installs the seams and calls in (one way).
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron_bitdet.errors import BitdetInputError, DeterminismViolation

class CheckDone(Exception):
    """``--check`` finished judging the launch line: unwind out of the script with this exit code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def chain(user_provider):
    """Megatron's ``extra_args_provider`` slot holds one function: the script's, then bitdet's."""
    from megatron_bitdet.megatron_lm.options import add_entry_args

    def provider(parser):
        if user_provider is not None:
            parser = user_provider(parser) or parser
        return add_entry_args(parser)

    return provider


def derive_recipe(session, args, audited=None):
    from megatron_bitdet.megatron_lm.args import recipe_from_args

    data = "mock" if getattr(args, "mock_data", False) else " ".join(map(str, getattr(args, "data_path", None) or [])) or None
    return recipe_from_args(args, session.base, script=os.path.basename(session.script), data=data,
                            deterministic=bool(args.deterministic_mode or session.check), audited=audited)


def launch_spec(args):
    """The object ``--spec MODULE NAME`` names (what Megatron's builder will build from), or None.
    Imported as megatron-core's ``spec_utils.import_module`` does, but its failure is exit 2 naming the module
    and the error: Megatron's logs an ImportError and returns None, read later as "no --spec"."""
    spec = getattr(args, "spec", None)
    if not spec:
        return None
    import importlib

    if len(spec) != 2:
        raise BitdetInputError(f"--spec {' '.join(spec)}: takes MODULE NAME (two values)")
    module, name = spec
    try:
        found = vars(importlib.import_module(module))
    except Exception as exc:  # any import failure of the user's module is bad input
        raise BitdetInputError(f"--spec {module} {name}: the spec module {module} could not be imported: "
                               f"{type(exc).__name__}: {exc}") from None
    if name not in found:
        raise BitdetInputError(f"--spec {module} {name}: the spec module {module} has no {name}")
    return found[name]


def judge(session, args):
    """The parsed args as a recipe, judged on what ``--spec`` will build (the audit), not only the flags:
    (recipe, settings, outcome, violations, warnings). A rule Megatron-LM itself asserts in deterministic
    mode cannot be opted out of."""
    from megatron_bitdet.enforce import Violation, plan
    from megatron_bitdet.enforce.audit import audit_spec, by_rule, recipe_keys
    from megatron_bitdet.enforce.megatron import MEGATRON_LM_ASSERTS
    from megatron_bitdet.enforce.rules import RULES_BY_ID
    from megatron_bitdet.megatron_lm.fixes import in_flags
    from megatron_bitdet.megatron_lm.line_rules import line_judgement

    spec = launch_spec(args)
    recipe = derive_recipe(session, args, recipe_keys(spec) if spec is not None else None)
    if not args.deterministic_mode and not session.check:
        return recipe, None
    # deterministic mode routes Mamba mixers to the split path (megatron_overrides)
    experts = getattr(args, "num_moe_experts", None)  # a spec walk finding no experts for these is refused
    runs = by_rule(audit_spec(spec, mem_eff_path=False, num_moe_experts=experts)) if spec is not None else None
    settings, outcome, violations, warnings = plan(recipe, late=not (session.check or session.preflight), runs=runs)
    violations += [Violation(o["id"], f"{o['message']}, opted out at {o['where']}; but Megatron-LM's validate_args "
                                      f"asserts it off in deterministic mode ({MEGATRON_LM_ASSERTS[o['id']]!r})",
                             RULES_BY_ID[o["id"]].why, RULES_BY_ID[o["id"]].fix)
                   for o in outcome.opt_outs if o["id"] in MEGATRON_LM_ASSERTS]
    violations = in_flags(violations, args, recipe_given=session.base is not None)
    line_violations, line_opt_outs = line_judgement(args, recipe)
    outcome.opt_outs += line_opt_outs
    warnings += [f"opt-out [{o['id']}] at {o['where']}: {o['message']} ({o['why']})" for o in line_opt_outs]
    return recipe, (settings, outcome, violations + line_violations, warnings)


def swap_spec(recipe, args, outcome, *, in_place: bool, config) -> None:
    """A swap replaces what was built: where the rules resolved te_grouped_gemm by a swap, or the recipe
    asks for ``expert_impl: grouped``, the experts ``--spec`` holds (it was built at its import, before
    any patch) become GroupedProbMLP — in the object Megatron builds from, or, for --check, in a copy;
    the outcome then records, per rule, what will run (``config``: the flags the model config will get)."""
    from megatron_bitdet.enforce.audit import audit_spec, flag_calls, runs_record
    from megatron_bitdet.megatron_lm.specs import swap_grouped_experts

    spec, findings = launch_spec(args), flag_calls(config)
    if spec is not None:
        if any(s["id"] == "te_grouped_gemm" for s in outcome.swaps) or recipe.model.moe.expert_impl == "grouped":
            spec, _ = swap_grouped_experts(spec, copy=not in_place,
                                           sequential=recipe.model.moe.expert_impl == "grouped")
        experts = getattr(args, "num_moe_experts", None)
        findings = audit_spec(spec, mem_eff_path=False, num_moe_experts=experts) + findings
    outcome.runs = runs_record(findings)


def _print_judgement(recipe, outcome, violations) -> None:
    out = sys.stdout
    for o in outcome.opt_outs:
        print(f"opted out [{o['id']}] {o['message']} (accepted at {o['where']}: {o['why']})", file=out)
    for s in outcome.swaps:
        print(f"swapped [{s['id']}] {s['message']} -> deterministic variant '{s['swap']}'", file=out)
    for rule, found in outcome.runs.items():
        print(f"runs [{rule}] " + "; ".join(f"{f['position']}: {f['runs']}" for f in found), file=out)
    if violations:
        print(str(DeterminismViolation(violations)), file=out)
    else:
        print(f"OK {recipe.name}: {len(outcome.applied)} rules clear, {len(outcome.opt_outs)} opted out, "
              f"{len(outcome.swaps)} swapped", file=out)


def machine_rows(session, recipe, config):
    """What this machine cannot run of the line (``machine.missing``), on the flags as the model config gets them."""
    from megatron_bitdet.megatron_lm.machine import missing

    return missing(config, launch_spec(config), os.path.basename(session.script), recipe.model.hybrid_pattern)


class _RefusingParser(argparse.ArgumentParser):
    """Megatron's parser whose errors are bad input (one line, exit 2) instead of a usage dump and an exit."""

    def error(self, message):
        raise BitdetInputError(f"the launch line: {message}")


def parse_line(argv, extra_args_provider=None, *, strict: bool = True):
    """``argv`` parsed by Megatron's parser with bitdet's options (and the script's ``extra_args_provider``)
    chained in, refusing instead of exiting: a bad value, or with ``strict`` an unknown flag (with the one
    meant, where one is close), is one line of bad input. Not ``strict``: flags the script's own provider
    adds are left alone (checked before the script runs: Megatron's in-process-restart wrapper parses the
    line at the script's start, exiting on a bad value with a usage dump)."""
    import difflib

    from megatron.training.arguments import add_megatron_arguments

    parser = chain(extra_args_provider)(add_megatron_arguments(_RefusingParser(allow_abbrev=False)))
    _, unknown = parser.parse_known_args(argv)
    if unknown and strict:
        flags = [a.split("=", 1)[0] for a in unknown
                 if a.startswith("-") and not parser._negative_number_matcher.match(a)]
        known = parser._option_string_actions
        named = [f + "".join(f" (did you mean {m}?)" for m in difflib.get_close_matches(f, known, n=1)) for f in flags]
        raise BitdetInputError(f"the launch line: unknown flag{'s' * (len(flags) > 1)} {', '.join(named)}" if flags
                               else f"the launch line: unexpected value{'s' * (len(unknown) > 1)} {' '.join(unknown)}")


def parsed(extra_args_provider):
    """The launch line parsed by the script's parser (bitdet's options chained in), after ``parse_line``."""
    from megatron.training.arguments import parse_args

    parse_line(sys.argv[1:], extra_args_provider)
    return parse_args(chain(extra_args_provider), ignore_unknown_args=False)


def flag_violations(session, args) -> list:
    """The determinism violations a line's flags alone decide (resolved as ``enable`` resolves them), for a line
    Megatron refused before deriving what the rules judge; and the line's own (``line_rules``)."""
    import copy

    from megatron_bitdet.enforce import apply_to_megatron_args
    from megatron_bitdet.megatron_lm.fixes import in_flags
    from megatron_bitdet.megatron_lm.line_rules import line_judgement

    if not args.deterministic_mode and not session.check:
        return []
    try:
        apply_to_megatron_args(copy.copy(args), session.base)
        found = []
    except DeterminismViolation as exc:
        found = in_flags(exc.violations, args, recipe_given=session.base is not None)
    return found + line_judgement(args, session.base)[0]


def refused(problems, violations=(), rows=()) -> BitdetInputError:
    """Every refusal of a line in one report: Megatron's own and the unsupported flags, the determinism
    violations, what this machine cannot run."""
    from megatron_bitdet.megatron_lm.machine import section

    return BitdetInputError("\n".join([*problems, *([str(DeterminismViolation(violations))] if violations else []),
                                       *([section(rows)] if rows else [])]))


def judge_line(session, args, validate_args, defaults=None):
    """The parsed ``args`` validated as Megatron does (a copy; ``validate_args``: Megatron's original,
    unwrapped) and judged: (validated args, recipe, judged, config, rows); ``config``: the flags as
    ``loop_hooks.on_validate`` leaves them for the model config; ``rows``: what this machine cannot run of it.
    A line refused as input (by Megatron's validate_args, an unsupported flag, a recipe disagreeing with it)
    raises one BitdetInputError listing that with everything else judged of it."""
    from megatron_bitdet.enforce import megatron_overrides
    from megatron_bitdet.enforce.megatron import MEGATRON_FLAG_RULES
    from megatron_bitdet.megatron_lm.validate import model_config_refusal, unsupported, validated

    problems = []
    try:
        checked = validated(args, validate_args, defaults, world_size=session.world_size)
    except BitdetInputError as exc:
        problems.append(str(exc))
        checked = None
    problems += unsupported(checked or args, os.path.basename(session.script))
    if checked is None:
        raise refused(problems, flag_violations(session, args))
    try:
        recipe, judged = judge(session, checked)
    except BitdetInputError as exc:
        raise refused([*problems, str(exc)], flag_violations(session, checked)) from None
    if judged is not None and not judged[2]:
        overrides = megatron_overrides(recipe)
    else:  # the line as it runs once its violations are fixed: a swapped feature is bitdet's variant, no row
        swapped = {s["id"] for s in judged[1].swaps} if judged is not None else set()
        overrides = {flag: False for flag, rule in MEGATRON_FLAG_RULES.items() if rule in swapped}
    config = argparse.Namespace(**{**vars(checked), **overrides})
    rows = machine_rows(session, recipe, config)
    problems += model_config_refusal(config)
    if problems:
        raise refused(problems, judged[2] if judged is not None else (), rows)
    return checked, recipe, judged, config, rows


def check_launch(session, extra_args_provider, validate_args, defaults=None) -> int:
    """``--check``: parse the launch line with the script's parser, validate it as Megatron does, judge it.
    Exit 2 on any determinism violation; else 3 when only this machine cannot run it (its own section:
    a production line judged on a laptop); 0 when clean and runnable here. The manifest is written
    (``--run-dir``) whenever the rules pass."""
    from megatron_bitdet.megatron_lm.machine import section

    args, recipe, judged, config, rows = judge_line(session, parsed(extra_args_provider), validate_args, defaults)
    session.opts.run_dir = args.run_dir
    _, outcome, violations, _ = judged
    swap_spec(recipe, args, outcome, in_place=False, config=config)
    _print_judgement(recipe, outcome, violations)
    if rows:
        print(section(rows), file=sys.stdout)
    if not violations and args.run_dir:
        from megatron_bitdet.enforce import Enforcement, write_manifest

        session.recipe = recipe
        import torch

        enforcement = Enforcement(mode=True, env=judged[0], rules=outcome, threads=torch.get_num_threads(),
                                  warnings=judged[3])
        write_manifest(session.run_dir, launch_manifest(session, enforcement, args, check=True))
    return 2 if violations else 3 if rows else 0


def preflight(session, extra_args_provider, validate_args, defaults=None) -> int:
    """Before any rank starts: the line as its ranks will judge it (the determinism violations with
    ``--deterministic-mode``, and what this machine cannot run), every problem at once in one
    BitdetInputError (exit 2); nothing is written. 0: the ranks may start."""
    from megatron_bitdet.megatron_lm.machine import section

    _, _, judged, _, rows = judge_line(session, parsed(extra_args_provider), validate_args, defaults)
    violations = judged[2] if judged is not None else []
    problems = ([str(DeterminismViolation(violations))] if violations else []) + ([section(rows)] if rows else [])
    if problems:
        raise BitdetInputError("no rank started:\n" + "\n".join(problems))
    return 0


def launch_manifest(session, enforcement, args, *, check: bool = False) -> dict:
    from megatron_bitdet.compat import cpu_backend
    from megatron_bitdet.compat.cpu_backend import training as training_seams
    from megatron_bitdet.enforce import build_manifest
    from megatron_bitdet.megatron_lm.line_rules import stop_conditions

    return build_manifest(
        session.recipe, enforcement, world_size=args.world_size, argv=session.argv,
        extra={"patches": session.patches, "cpu_backend_seams": cpu_backend.installed() + training_seams.installed(),
               "megatron_lm": {"script": session.script, "check": check, "spec_family": session.recipe.model.spec,
                               "stop": stop_conditions(args)},
               "trace": None if session.trace is None else session.trace.to_json()},
    )


