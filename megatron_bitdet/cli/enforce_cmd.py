"""`bitdet enforce`: validate a recipe, apply --deterministic-mode, show the environment and the manifest."""
from __future__ import annotations

import argparse
import json
import sys

EXAMPLES = """examples:
  bitdet enforce --recipe nemotron_h_tiny
  bitdet enforce --recipe nemotron_h_tiny --run-dir runs/x determinism.threads=1
  NCCL_ALGO=Tree bitdet enforce --recipe nemotron_h_tiny   # refused: [nccl_tree]

exit status: 0 applied, 2 bad recipe or a feature without a deterministic path"""


def register(subparsers, summary):
    p = subparsers.add_parser("enforce", help=summary, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              description="Validate a recipe, apply the canonical determinism environment and "
                              "torch flags in this process, print the applied environment and the run manifest.")
    p.add_argument("--recipe", required=True, metavar="RECIPE", help="a shipped recipe's name (e.g. nemotron_h_tiny) or a recipe YAML file")
    p.add_argument("--run-dir", metavar="DIR", help="also write DIR/manifest.json (atomically)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. parallel.tensor=2")
    p.set_defaults(func=run)


def _env_table(enforcement):
    from rich.table import Table

    table = Table(title="determinism environment")
    for col in ("variable", "value", "source"):
        table.add_column(col)
    for name, setting in enforcement.env.items():
        table.add_row(name, "-" if setting.value is None else setting.value, setting.source)
    return table


def run(args) -> int:
    from rich.console import Console
    from rich.text import Text

    from megatron_bitdet.enforce import build_manifest, enable, write_manifest
    from megatron_bitdet.recipe import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    enforcement = enable(recipe)
    manifest = build_manifest(recipe, enforcement, world_size=1)
    err = Console(stderr=True)
    for w in enforcement.warnings:
        err.print(Text("warning: ", style="yellow") + Text(w), highlight=False)
    err.print(_env_table(enforcement))
    json.dump(manifest, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    if args.run_dir:
        print(f"wrote {write_manifest(args.run_dir, manifest)}", file=sys.stderr)
    return 0
