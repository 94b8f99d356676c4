"""`bitdet train`: pretrain the hybrid Nemotron on megatron-core with per-step fingerprints."""
from __future__ import annotations

import argparse
import os
import sys

from megatron_bitdet.trace.options import add_trace_args, trace_settings

EXAMPLES = """examples:
  bitdet train --recipe nemotron_h_tiny --deterministic-mode --nproc 2 --run-dir runs/a
  bitdet train --recipe nemotron_h_tiny --nproc 2 --run-dir runs/a --save-interval 4
  bitdet train --recipe nemotron_h_tiny --nproc 2 --run-dir runs/b --load runs/a/checkpoints
  bitdet train --recipe R --nproc 2 --run-dir runs/c --model-provider my_models:provider parallel.tensor=2
  bitdet train --recipe R --nproc 2 --run-dir runs/t --trace op --trace-steps 3-4 --trace-ranks 0
  torchrun --nproc-per-node 8 -m megatron_bitdet train --recipe R --nproc 8 --run-dir runs/gpu   # GPU cluster

run directory: manifest.json, fingerprints/rank_XXXXX.jsonl, checkpoints/iter_N/, logs/rank_XXXXX.log,
               traces/rank_XXXXX.trace.jsonl (with --trace)"""


def _default_nproc() -> int:
    from megatron_bitdet.train.launch import under_torchrun

    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else 2


def add_run_args(p, *, recipe_required: bool = True) -> None:
    """Arguments shared by every command that trains (train, verify-resume, prove, tax)."""
    p.add_argument("--recipe", required=recipe_required, metavar="RECIPE", help="a shipped recipe's name (e.g. nemotron_h_tiny) or a recipe YAML file")
    p.add_argument("--nproc", type=int, default=_default_nproc(),
                   help="ranks on this machine (default 2; under torchrun its WORLD_SIZE)")
    p.add_argument("--deterministic-mode", action="store_true",
                   help="force determinism.mode=true (the recipe's default); determinism.mode=false runs the baseline")
    p.add_argument("--model-provider", metavar="MODULE:FUNC",
                   help="custom builder with the default's signature (recipe, config, *, pre_process, post_process)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. training.iterations=4")


def add_launcher_arg(p) -> None:
    """``--launcher`` on a workflow's parser (after its ``set_defaults(func=...)``): every launch of the
    command goes through the template (``train.launch.through``), validated before any rank starts;
    ``--nproc``, when the parser has it, defaults to the template's world size and must agree with it."""
    p.add_argument("--launcher", action="append", metavar="TEMPLATE",
                   help="start every launch's ranks through this cluster launcher: a torchrun line (given once per "
                        "node, each led by what runs it there) or an srun line (once); bitdet appends the rank program")
    func, has_nproc = p.get_default("func"), p.get_default("nproc") is not None
    if has_nproc:
        p.set_defaults(nproc=None)

    def through_launcher(args):
        from megatron_bitdet.train.launch import parse_launcher, through

        launcher = parse_launcher(args.launcher)
        if has_nproc:
            args.nproc = args.nproc or (launcher.world_size if launcher else _default_nproc())
            if launcher:
                launcher.check_world(args.nproc)
        with through(launcher):
            return func(args)

    p.set_defaults(func=through_launcher)


def register(subparsers, summary):
    p = subparsers.add_parser("train", help=summary, description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p)
    p.add_argument("--run-dir", required=True, help="where manifest, fingerprints, checkpoints and logs go")
    p.add_argument("--save", metavar="DIR", help="checkpoint root (default RUN_DIR/checkpoints)")
    p.add_argument("--save-interval", type=int, default=None, help="save every K iterations")
    p.add_argument("--load", metavar="DIR", help="resume from a checkpoint root (its 'latest') or one iter_N dir")
    p.add_argument("--stop-at", type=int, metavar="K", help="stop after iteration K (simulates an interruption)")
    add_trace_args(p)
    p.set_defaults(func=run)


def load_run_recipe(args):
    from megatron_bitdet.recipe import load_recipe

    overrides = list(args.overrides)
    if args.deterministic_mode:
        overrides.append("determinism.mode=true")
    return load_recipe(args.recipe, overrides)


def run(args) -> int:
    trace = trace_settings(args)
    recipe = load_run_recipe(args)
    if args.model_provider:
        from megatron_bitdet.model.builder import load_model_provider

        sys.path.insert(0, os.getcwd())
        load_model_provider(args.model_provider)  # fail here, before any rank starts
    if args.load:
        from megatron_bitdet.train.checkpoint import check_recipe_shapes, resolve_checkpoint, verify_checkpoint

        # an incomplete, foreign or corrupt checkpoint, or one of other shapes, is refused before any rank starts
        path = resolve_checkpoint(args.load)
        check_recipe_shapes(path, verify_checkpoint(path), recipe)
    from megatron_bitdet.train.run import RunOptions, launch_training

    return launch_training(recipe, RunOptions(
        nproc=args.nproc, run_dir=args.run_dir, save=args.save, save_interval=args.save_interval, load=args.load,
        model_provider=args.model_provider, stop_at=args.stop_at, argv=sys.argv, trace=trace,
    ))
