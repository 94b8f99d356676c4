"""The automatic ladder: from two runs with fingerprints only to "this op in this module on this rank at
this step".

compare_runs finds the first divergent step (a scope mismatch is refused, as in compare). Both runs
are then re-launched from their manifests (resolved recipe, model provider, world size) up to that
step, with tracing on only in a small window before it, one level at a time: semantic (which step
and phase: gradient reduction, optimizer, collectives), module (which module), op (which dispatcher
op). Each rung narrows the next: the steps to the rung's culprit step, and at op level the ranks to
the culprit rank when it is a producer. Rung outputs go to RUN_X/ladder/<level>/.

A divergence that does not reappear in a rung's re-runs is intermittent: the ladder stops and says
which rung and window it tried (the runs still diverged, so the exit code stays 1).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_bitdet.analysis.compare import compare_runs
from megatron_bitdet.analysis.localize import PRODUCER, LocalizeConfig, localize_traces
from megatron_bitdet.enforce.manifest import load_manifest
from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.rundir import logs_dir, manifest_path
from megatron_bitdet.trace import TraceConfig
from megatron_bitdet.trace.format import LEVELS


@dataclass(frozen=True)
class LadderConfig:
    levels: tuple[str, ...] = LEVELS
    context: int = 1                 # steps traced before the first divergent one (its inputs' history)
    localize: LocalizeConfig = LocalizeConfig()

    def __post_init__(self):
        bad = [lv for lv in self.levels if lv not in LEVELS]
        if bad or not self.levels:
            raise BitdetInputError(f"ladder levels {list(self.levels)}: expected some of {', '.join(LEVELS)}")
        if self.context < 0:
            raise BitdetInputError(f"ladder context {self.context}: must be >= 0")


@dataclass
class Rung:
    level: str
    steps: list[int]
    ranks: list[int] | None
    run_dirs: list[str]
    mismatch: bool
    culprit: dict | None
    events_compared: int


@dataclass
class LadderResult:
    run_a: str
    run_b: str
    diverged: bool
    first_step: int | None = None
    first_ranks: list[int] = field(default_factory=list)
    first_metrics: list[str] = field(default_factory=list)
    rungs: list[Rung] = field(default_factory=list)
    culprit: dict | None = None
    reproduced: bool | None = None   # None: not diverged; False: some rung saw no divergence
    note: str = ""

    @property
    def exit_code(self) -> int:
        return 1 if self.diverged else 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Relaunch:
    """What a run's manifest says is needed to run it again."""

    recipe: object
    nproc: int
    model_provider: str | None


def _relaunch_spec(run_dir) -> _Relaunch:
    from megatron_bitdet.recipe import Recipe

    m = load_manifest(run_dir)
    argv = m.get("argv") or []
    if "--load" in argv or any(a.startswith("--load=") for a in argv):
        raise BitdetInputError(f"{run_dir}: the run resumed from a checkpoint; the ladder re-runs from "
                               "iteration 0. Trace it yourself: bitdet train --load ... --trace LEVEL")
    try:
        recipe = Recipe.from_dict(m["recipe"], source=str(manifest_path(run_dir)))
        nproc = int(m["scope"]["world_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BitdetInputError(f"{manifest_path(run_dir)}: cannot re-launch from it ({exc})") from None
    provider = m.get("model_provider")
    if provider:
        from megatron_bitdet.model.builder import load_model_provider

        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        load_model_provider(provider)  # the ranks import it from this directory too
    return _Relaunch(recipe, nproc, provider)


def _relaunch_both(specs, runs, level: str, steps: list[int], ranks) -> list[Path]:
    """Re-run A and B side by side with tracing on in the window; their consoles go to stderr."""
    from megatron_bitdet.train.run import RunOptions, launch_training

    trace = TraceConfig(level, tuple(steps), None if ranks is None else frozenset(ranks))
    outs = [Path(run) / "ladder" / level for run in runs]
    codes: list = [None, None]

    def one(i):
        try:
            codes[i] = launch_training(specs[i].recipe, RunOptions(
                nproc=specs[i].nproc, run_dir=outs[i], stop_at=steps[1], model_provider=specs[i].model_provider,
                trace=trace, argv=("bitdet", "localize", "(ladder)", level), fresh=True))
        except BaseException as exc:  # reported below, in this thread
            codes[i] = exc

    print(f"[ladder] {level}: re-running both runs to step {steps[1]}, tracing steps {steps[0]}-{steps[1]}, "
          f"ranks {'all' if ranks is None else ranks}", file=sys.stderr, flush=True)
    with contextlib.redirect_stdout(sys.stderr):
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for out, code in zip(outs, codes):
        if isinstance(code, BaseException):
            raise code
        if code != 0:
            raise BitdetError(f"ladder re-run into {out} failed (exit {code}); see {logs_dir(out)}")
    return outs


def run_ladder(run_a, run_b, config: LadderConfig = LadderConfig()) -> LadderResult:
    """Fingerprints → first divergent step → traced re-runs, one level per rung → culprit."""
    cmp = compare_runs(run_a, run_b)
    if cmp.verdict == "incomplete":
        raise BitdetInputError(f"{run_a} and {run_b}: the {cmp.steps_compared} common steps match, but steps "
                               f"{cmp.steps_only_in_a or cmp.steps_only_in_b} are in one run only (a run stopped "
                               "early?): nothing to localize, and not a match")
    result = LadderResult(str(run_a), str(run_b), diverged=cmp.verdict == "diverged")
    if not result.diverged:
        result.note = f"fingerprints match over {cmp.steps_compared} steps: nothing to localize"
        return result
    div = cmp.first_divergence
    result.first_step, result.first_ranks, result.first_metrics = div.step, div.ranks, div.metrics
    specs = [_relaunch_spec(run_a), _relaunch_spec(run_b)]
    steps, ranks = [max(1, div.step - config.context), div.step], None
    for level in config.levels:
        outs = _relaunch_both(specs, (run_a, run_b), level, steps, ranks)
        found = localize_traces(*outs, config.localize)
        c = found.culprit
        result.rungs.append(Rung(level, list(steps), ranks, [str(o) for o in outs], found.mismatch, c,
                                 found.events_compared))
        if not found.mismatch:
            result.reproduced = False
            result.note = (f"intermittent: the divergence at step {div.step} did not reproduce in the {level} "
                           f"re-runs (steps {steps[0]}-{steps[1]}, ranks {'all' if ranks is None else ranks}); "
                           f"rungs tried: {', '.join(r.level for r in result.rungs)}")
            return result
        result.culprit = c
        steps = [c["step"], c["step"]]
        if c["classification"] == PRODUCER and not c.get("receivers"):
            ranks = [c["rank"]]
    result.reproduced = True
    return result


def describe(culprit: dict) -> str:
    """One line: this op in this module on this rank at this step."""
    where = f"module {culprit['module'] or '(top level)'}"
    return (f"{culprit['op']} in {where} on rank {culprit['rank']} at step {culprit['step']} "
            f"({culprit['phase']}): {culprit['classification']} — {culprit['evidence']}")
