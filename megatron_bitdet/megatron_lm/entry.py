"""Run a Megatron-LM pretraining script unmodified under bitdet.

``python -m megatron_bitdet.megatron_lm [--check] PATH/pretrain_mamba.py --deterministic-mode
[--recipe R.yaml] [--run-dir DIR] <Megatron args>`` (one rank; torchrun starts N of them).

Order, because determinism needs it: (1) the canonical environment, before the script's first import
(NCCL, cuBLAS, TE and mamba-ssm read it at import or first use); (2) the CPU seams where there is no
CUDA, megatron.training's included; (3) hooks on Megatron's own seams (``pretrain`` chains bitdet's
arguments into the script's ``extra_args_provider``; ``validate_args`` judges the parsed args — the
model that will really be built — enables torch's flags and installs the swaps before any process
group or model exists; ``train_step`` writes the per-step fingerprints and, with ``--trace``, the traces);
(4) the script, as ``__main__``.
"""
from __future__ import annotations

import os
import sys

from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.megatron_lm.options import preparse

USAGE = "python -m megatron_bitdet.megatron_lm [--check] SCRIPT.py [--deterministic-mode] [--recipe R] <Megatron args>"


def load_base_recipe(opts):
    """The ``--recipe`` (with ``--bitdet-override``s), or None: default determinism settings. A recipe
    that asks for determinism (``determinism.mode: true``) on a line without ``--deterministic-mode`` is
    refused: the launch would enforce nothing while ``--check`` judged the line as deterministic."""
    if not opts.recipe:
        if opts.bitdet_override:
            raise BitdetInputError("--bitdet-override needs --recipe")
        return None
    from megatron_bitdet.recipe import load_recipe

    base = load_recipe(opts.recipe, opts.bitdet_override)
    if base.determinism.mode and not opts.deterministic_mode:
        raise BitdetInputError(f"--recipe {opts.recipe} asks for determinism (determinism.mode: true) but the line has "
                               f"no --deterministic-mode, so the launch would enforce nothing: add --deterministic-mode "
                               f"(or set determinism.mode: false in the recipe)")
    return base


class DefaultDeterminism:
    """Stands for "no --recipe": the schema's default determinism section, located nowhere."""

    def __init__(self):
        from megatron_bitdet.recipe.schema import DeterminismConfig

        self.determinism = DeterminismConfig()

    def where(self, *_path) -> str:
        return "bitdet's default determinism settings"


def canonical_env(base) -> dict:
    """The canonical environment for the determinism section (launcher values validated, never
    overwritten); raises DeterminismViolation listing every problem."""
    from megatron_bitdet.enforce import Violation
    from megatron_bitdet.enforce.env import ENV_BY_NAME, effective_env, resolve_env
    from megatron_bitdet.errors import DeterminismViolation

    settings, problems = resolve_env(base if base is not None else DefaultDeterminism(), os.environ)
    if problems:
        raise DeterminismViolation([Violation(f"env:{n}", m, ENV_BY_NAME[n].why, f) for n, m, f in problems])
    return effective_env(settings)


def split_argv(argv: list[str]):
    """(check, script, rest): options before the script are the entry's own."""
    check = False
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] == "--check":
            check = True
        else:
            raise BitdetInputError(f"unknown option {argv[i]!r} before the script; usage: {USAGE}")
        i += 1
    if i >= len(argv):
        raise BitdetInputError(f"no script given; usage: {USAGE}")
    script = argv[i]
    if not os.path.isfile(script):
        raise BitdetInputError(f"{script}: no such script")
    return check, script, argv[i + 1:]


def run_as_main(script: str) -> None:
    """Execute the script as ``__main__`` without putting it in ``sys.modules['__main__']``: helpers
    that spawn interpreters (dist_checkpointing's save) re-import the *entry's* main module, not the
    script (which would run again there without the CPU seams). Without CUDA, the script's own CUDA moves
    point at the CPU (``cpu_backend.training.script_source``). A script that runs another as ``__main__``
    through ``runpy.run_path`` (Megatron-LM 0.18+'s deprecated ``pretrain_mamba.py`` runs
    ``pretrain_hybrid.py``) has that one run the same way."""
    import runpy

    from megatron_bitdet.compat.cpu_backend.training import script_source

    with open(script, encoding="utf-8") as fh:
        code = compile(script_source(fh.read()), script, "exec")
    original = runpy.run_path

    def run_path(path_name, init_globals=None, run_name=None):
        if run_name != "__main__" or init_globals:
            return original(path_name, init_globals, run_name)
        run_as_main(os.fspath(path_name))
        return {}

    runpy.run_path = run_path
    try:
        exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__,
                    "__package__": None, "__spec__": None, "__loader__": None, "__cached__": None})
    finally:
        runpy.run_path = original


def run(script: str, rest: list[str], *, check: bool = False, world_size: int | None = None,
        preflight: bool = False) -> int:
    """Everything in this process; returns the exit code (the script's SystemExit code included).
    ``world_size``: a ``--check``'s world (the launch's ``--nproc``), where the environment does not say it.
    ``preflight``: judge the line as its ranks will, before they start (``judging.preflight``)."""
    from megatron_bitdet.megatron_lm import loop_hooks
    from megatron_bitdet.megatron_lm.judging import CheckDone, parse_line

    opts = preparse(rest)
    base = load_base_recipe(opts)
    if opts.deterministic_mode and not (check or preflight):  # under torchrun: re-executes this rank if its str hashing is not the canonical one
        from megatron_bitdet.train.launch import adopt_env

        adopt_env(canonical_env(base))
    script = os.path.abspath(script)
    sys.path.append(os.path.dirname(script))  # after site-packages: megatron.core stays the installed wheel
    import torch

    if not torch.cuda.is_available():
        from megatron_bitdet.compat.cpu_backend import training as training_seams

        training_seams.install()
    parse_line(rest, strict=False)  # a bad value: one line, before the script's first parse exits with a usage dump
    session = loop_hooks.Session(script=script, argv=[script, *rest], base=base, opts=opts, check=check,
                                 world_size=world_size, preflight=preflight)
    loop_hooks.install(session)
    sys.argv = [script, *rest]
    try:
        run_as_main(script)
    except CheckDone as done:
        return done.code
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        session.close()
    return 0


def main(argv: list[str], *, world_size: int | None = None) -> int:
    try:
        check, script, rest = split_argv(argv)
        return run(script, rest, check=check, world_size=world_size)
    except BitdetError as exc:
        print(f"bitdet megatron-lm: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def rank_worker(rank: int, world_size: int, *, script: str, argv: list, check: bool = False) -> int:
    """One rank of ``bitdet megatron-lm --nproc N`` (``train.launch``): Megatron creates the process group."""
    return run(script, list(argv), check=check)


rank_worker.owns_process_group = True
