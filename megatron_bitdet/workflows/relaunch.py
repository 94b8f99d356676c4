"""Running a finished run again from its manifest (the localize ladder, replay): what to launch, read
once here, and the launch.

A ``bitdet train`` run is re-launched from its resolved recipe, world size and model provider; a
Megatron-LM run (``manifest["megatron_lm"]``) from its script and launch line, through the entry point.
Checks that depend on what the caller does with the re-run (the ladder starts from iteration 0, replay
needs a recipe this version validates) stay with the caller.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_bitdet.enforce.manifest import load_manifest
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import fresh, manifest_path


class StaleRecipe(BitdetInputError):
    """The run's recorded recipe does not validate under this bitdet version."""

    def __init__(self, where: Path, version, error: BitdetInputError):
        super().__init__(f"{where}: the run's recipe (bitdet {version}) does not validate here:\n{error}")
        self.where, self.version, self.error = where, version, error


@dataclass(frozen=True)
class RelaunchSpec:
    """What a run's manifest says is needed to run it again."""

    run_dir: str
    nproc: int
    argv: tuple[str, ...]                 # as recorded
    recipe: object = None                 # bitdet train runs: the resolved recipe
    model_provider: str | None = None
    script: str | None = None             # Megatron-LM runs: the script, and its launch line after it
    megatron_args: tuple[str, ...] = ()

    @property
    def megatron_lm(self) -> bool:
        return self.script is not None


def _from_here() -> None:
    """The ranks import the run's own modules (model provider, layer spec) from this directory."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _importable_from_here(module: str, what: str) -> None:
    """Refuse before any rank starts when the ranks could not import ``module``."""
    _from_here()
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise BitdetInputError(f"{what} {module!r} is not importable from {os.getcwd()}: run from the directory "
                               "the run was launched in")


def relaunch_spec(run_dir, overrides=()) -> RelaunchSpec:
    """Read RUN_DIR/manifest.json into a RelaunchSpec; ``overrides`` ('key=value') change a bitdet train
    run's recipe first. BitdetInputError naming the file and key when it cannot be re-launched from;
    StaleRecipe when the recorded recipe does not validate."""
    where = manifest_path(run_dir)
    m = load_manifest(run_dir)
    argv = m.get("argv") or []
    try:
        nproc = int(m["scope"]["world_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BitdetInputError(f"{where}: scope.world_size: cannot re-launch from it ({exc!r})") from None
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise BitdetInputError(f"{where}: argv: expected a list of strings")
    mlm = m.get("megatron_lm")
    if mlm is not None:
        return _megatron_lm_spec(run_dir, where, mlm, argv, nproc, overrides)
    from megatron_bitdet.recipe import Recipe
    from megatron_bitdet.recipe.loader import apply_overrides

    if not isinstance(m["recipe"], dict):
        raise BitdetInputError(f"{where}: recipe: expected a mapping")
    data = copy.deepcopy(m["recipe"])
    issues = apply_overrides(data, {}, overrides)
    if issues:
        raise BitdetInputError("\n".join(issues))
    try:
        recipe = Recipe.from_dict(data, source=str(where))
    except BitdetInputError as exc:
        raise StaleRecipe(where, m.get("bitdet_version"), exc) from None
    provider = m.get("model_provider")
    if provider is not None and not isinstance(provider, str):
        raise BitdetInputError(f"{where}: model_provider: expected MODULE:FUNC")
    if provider:
        from megatron_bitdet.model.builder import load_model_provider

        _from_here()
        load_model_provider(provider)
    return RelaunchSpec(str(run_dir), nproc, tuple(argv), recipe=recipe, model_provider=provider)


def _megatron_lm_spec(run_dir, where: Path, mlm, argv: list, nproc: int, overrides) -> RelaunchSpec:
    if overrides:
        raise BitdetInputError(f"{run_dir}: a Megatron-LM run: its flags define it, recipe overrides do not apply")
    if not isinstance(mlm, dict) or not isinstance(mlm.get("script"), str):
        raise BitdetInputError(f"{where}: megatron_lm.script: expected the script's path")
    if mlm.get("check"):
        raise BitdetInputError(f"{where}: written by `bitdet megatron-lm --check` (a judged launch line, no run)")
    script = mlm["script"]
    if not os.path.isfile(script):
        raise BitdetInputError(f"{where}: megatron_lm.script: {script} does not exist here (re-running needs "
                               "the Megatron-LM checkout the run was launched from)")
    if not argv or os.path.abspath(argv[0]) != os.path.abspath(script):
        raise BitdetInputError(f"{where}: argv: expected the script ({script}) then its launch line")
    rest = argv[1:]
    if "--spec" in rest:  # Megatron imports the layer spec's module in every rank
        spec = rest[rest.index("--spec") + 1:rest.index("--spec") + 2]
        if spec and not spec[0].startswith("-"):
            _importable_from_here(spec[0], "the run's --spec module")
    return RelaunchSpec(str(run_dir), nproc, tuple(argv), script=script, megatron_args=tuple(rest))


def flag_value(megatron_args: list, flag: str) -> str | None:
    """``flag``'s value on a launch line (``--flag V`` or ``--flag=V``; the last one given), or None."""
    value = None
    for i, arg in enumerate(megatron_args):
        name, eq, inline = arg.partition("=")
        if name == flag:
            value = inline if eq else (megatron_args[i + 1] if i + 1 < len(megatron_args) else None)
    return value


def relaunch(spec: RelaunchSpec, run_dir, *, stop_at: int | None = None, trace=None, argv=None, load=None,
             worker: str | None = None, worker_args: dict | None = None) -> int:
    """Run ``spec`` again into the emptied ``run_dir`` (stopping after iteration ``stop_at``, traced per
    ``trace``, a TraceConfig); returns the exit code. ``argv``: what a bitdet train re-run's manifest records.
    Megatron-LM runs only: ``load`` (ROOT, ITERATION) replaces what the line loads with that checkpoint;
    ``worker`` / ``worker_args``: another rank worker (``launch_line``)."""
    if spec.megatron_lm:
        from megatron_bitdet.megatron_lm.launch import launch_line, rerun_args

        fresh(run_dir)
        line = list(spec.megatron_args)
        if load is not None:
            line = rerun_args(line, drop=("--load", "--ckpt-step")) + ["--load", str(load[0]), "--ckpt-step",
                                                                       str(load[1])]
        for flag in dict.fromkeys(a for a in line if a in ("--exit-duration-in-mins", "--exit-signal-handler")):
            print(f"[bitdet] note: the re-run drops {flag} from the line: it stops "
                  f"{'at the end of its schedule' if stop_at is None else f'after iteration {stop_at}'}",
                  file=sys.stderr, flush=True)
        return launch_line(spec.script, rerun_args(line, stop_at=stop_at, trace=trace), nproc=spec.nproc,
                           run_dir=run_dir, worker=worker, worker_args=worker_args)
    from megatron_bitdet.train.run import RunOptions, launch_training

    return launch_training(spec.recipe, RunOptions(nproc=spec.nproc, run_dir=run_dir, stop_at=stop_at,
                                                   model_provider=spec.model_provider, trace=trace, argv=argv,
                                                   fresh=True))
