"""`bitdet recipe validate|show`: strict recipe checks (schema + determinism rules) and the resolved YAML."""
from __future__ import annotations

import argparse
import sys

import yaml

EXAMPLES = """examples:
  bitdet recipe validate nemotron_h_tiny
  bitdet recipe validate nemotron_h_tiny model.moe.router_fusion=true   # refused: rule id, why, fix
  bitdet recipe show nemotron3_nano parallel.tensor=2
  bitdet recipe megatron-args nemotron_h_8b     # the same run as Megatron-LM flags

exit status: 0 valid, 2 schema error or a feature without a deterministic path"""


def _overrides(p):
    p.add_argument("path", metavar="RECIPE", help="a shipped recipe's name (e.g. nemotron_h_tiny) or a recipe YAML file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="override a key (value parsed as YAML), e.g. model.hidden_size=128")


def register(subparsers, summary):
    parser = subparsers.add_parser("recipe", help=summary, description="Validate or show a bitdet YAML recipe.",
                                   epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="recipe_command", metavar="ACTION", required=True)
    for name, func, help_text, description in (
        ("validate", run_validate, "check the schema and (determinism.mode) the determinism rules",
         "Check every key (file:line errors, all at once) and, when determinism.mode is true, refuse features "
         "without a deterministic path."),
        ("show", run_show, "print the fully resolved recipe (extends + overrides) as YAML",
         "Print the resolved recipe: extends merged, overrides applied, defaults filled."),
        ("megatron-args", run_megatron_args, "print the recipe's model/parallel/training as Megatron-LM flags",
         "Render the model, parallel and training sections as pretrain_mamba.py flags (pass the recipe too, "
         "with --recipe, for its determinism section)."),
    ):
        action = sub.add_parser(name, help=help_text, description=description, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        _overrides(action)
        action.set_defaults(func=func)


def summary_line(recipe) -> str:
    m = recipe.model
    return (f"{recipe.name}: {m.num_layers} layers '{m.hybrid_pattern}', hidden {m.hidden_size}, "
            f"tp{recipe.parallel.tensor} pp{recipe.parallel.pipeline} ep{recipe.parallel.expert}, "
            f"digest {recipe.digest()}")


def run_validate(args) -> int:
    from megatron_bitdet.recipe import load_recipe

    recipe = load_recipe(args.path, args.overrides)
    if recipe.determinism.mode:
        from megatron_bitdet.enforce import plan
        from megatron_bitdet.errors import DeterminismViolation

        _, outcome, violations, warnings = plan(recipe, late=False)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        if violations:
            raise DeterminismViolation(violations)
        print(f"OK {summary_line(recipe)}; {len(outcome.applied)} rules clear, "
              f"{len(outcome.opt_outs)} opted out, {len(outcome.swaps)} swapped")
        for swap in outcome.swaps:
            print(f"swapped [{swap['id']}] {swap['message']} -> deterministic variant '{swap['swap']}'")
    else:
        print(f"OK {summary_line(recipe)}; determinism.mode is false: rules not evaluated")
    return 0


def run_show(args) -> int:
    from megatron_bitdet.recipe import load_recipe

    recipe = load_recipe(args.path, args.overrides)
    sys.stdout.write(yaml.safe_dump(recipe.to_dict(), sort_keys=False, default_flow_style=None))
    return 0


def run_megatron_args(args) -> int:
    from megatron_bitdet.megatron_lm.args import render_line
    from megatron_bitdet.recipe import load_recipe

    print(render_line(load_recipe(args.path, args.overrides)))
    return 0
