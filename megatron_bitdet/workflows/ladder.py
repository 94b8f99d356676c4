"""The automatic ladder: from two runs with fingerprints only to "this op in this module on this rank at
this step".

compare_runs finds the first divergent step (a scope mismatch is refused, as in compare). Both runs
are then re-launched from their manifests (workflows.relaunch: a bitdet train run from its resolved
recipe, model provider and world size; a Megatron-LM run from its script and launch line) up to that
step, with tracing on only in a small window before it, one level at a time: semantic (which step
and phase: gradient reduction, optimizer, collectives), module (which module), op (which dispatcher
op). Each rung narrows the next: the steps to the rung's culprit step, and at op level the ranks to
the culprit rank when it is a producer. Rung outputs go to RUN_X/ladder/<level>/.

A divergence that does not reappear in a rung's re-runs is intermittent: the ladder stops and says
which rung and window it tried (the runs still diverged, so the exit code stays 1).

The last rung is the kernel rung: for an op-level producer both runs are re-run once more with that
op occurrence's inputs captured on the culprit rank (RUN_X/ladder/kernel/captures/), and the op is
replayed in isolation (analysis.kernel_replay) to name its mechanism.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_bitdet.analysis.compare import compare_runs
from megatron_bitdet.analysis.localize import BLIND_SPOT, CONTROL, PRODUCER, LocalizeConfig, localize_traces
from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.rundir import logs_dir, read_result
from megatron_bitdet.trace import TraceConfig
from megatron_bitdet.trace.format import LEVELS
from megatron_bitdet.workflows.relaunch import RelaunchSpec, relaunch, relaunch_spec


@dataclass(frozen=True)
class LadderConfig:
    levels: tuple[str, ...] = LEVELS
    context: int = 1                 # steps traced before the first divergent one (its inputs' history)
    localize: LocalizeConfig = LocalizeConfig()
    kernel: bool = True              # end with the kernel rung (capture + isolated replay)
    retries: int = 1                 # re-runs of a rung whose window showed no mismatch (intermittent sources)
    repeats: int = 20                # kernel rung: replays per configuration

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
    kernel: dict | None = None       # the kernel rung: {"status", "verdict", "mechanism", ...}

    @property
    def exit_code(self) -> int:
        return 1 if self.diverged else 0

    def to_json(self) -> dict:
        return asdict(self)


def _ladder_spec(run_dir) -> RelaunchSpec:
    """The run's re-launch spec; a run resumed from a checkpoint is refused (the ladder re-runs from iteration 0)."""
    spec = relaunch_spec(run_dir)
    if "--load" in spec.argv or any(a.startswith("--load=") for a in spec.argv):
        how = "its launch line with --load ... --trace LEVEL" if spec.megatron_lm else "bitdet train --load ... --trace LEVEL"
        raise BitdetInputError(f"{run_dir}: the run resumed from a checkpoint; the ladder re-runs from "
                               f"iteration 0. Trace it yourself: {how}")
    return spec


def _relaunch_both(specs, runs, level: str, steps: list[int], ranks, capture=None, rung=None) -> list[Path]:
    """Re-run A and B side by side with tracing on in the window; their consoles go to stderr."""
    trace = TraceConfig(level, tuple(steps), None if ranks is None else frozenset(ranks), capture=capture)
    outs = [Path(run) / "ladder" / (rung or level) for run in runs]
    codes: list = [None, None]

    def one(i):
        try:
            codes[i] = relaunch(specs[i], outs[i], stop_at=steps[1], trace=trace,
                                argv=("bitdet", "localize", "(ladder)", level))
        except BaseException as exc:  # reported below, in this thread
            codes[i] = exc

    print(f"[ladder] {rung or level}: re-running both runs to step {steps[1]}, tracing steps {steps[0]}-{steps[1]}, "
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


RESULT_FILE = "result.json"


def ladder_result_path(run_a) -> Path:
    return Path(run_a) / "ladder" / RESULT_FILE


def load_ladder_result(run_a, run_b) -> dict | None:
    """The saved ladder of this pair (None when absent or made for another run B)."""
    path = ladder_result_path(run_a)
    data = read_result(path, "ladder result", ("diverged", "run_b"))
    if data is None:
        return None
    problem = _ladder_result_problem(data)
    if problem:
        raise BitdetInputError(f"{path}: not a ladder result ({problem})")
    return data if Path(data["run_b"]).resolve() == Path(run_b).resolve() else None


def _ladder_result_problem(data: dict) -> str:
    """What doctor reads of a saved ladder, with the types the ladder writes."""
    if not isinstance(data["run_b"], str) or not data["run_b"] or "\0" in data["run_b"]:
        return "run_b is not a path"
    if type(data["diverged"]) is not bool:
        return "diverged is not true or false"
    step, metrics = data.get("first_step"), data.get("first_metrics", [])
    if not (step is None or type(step) is int) or not isinstance(metrics, list) \
            or not all(isinstance(m, str) for m in metrics):
        return "first_step / first_metrics of the wrong type"
    for key, fields in (("culprit", ("classification", "op", "module", "evidence")),
                        ("kernel", ("mechanism", "deterministic_variant"))):
        value = data.get(key)
        if value is not None and (not isinstance(value, dict) or not all(
                value.get(f) is None or isinstance(value[f], str) for f in fields)):
            return f"{key} is not an object of strings ({', '.join(fields)})"
    return ""


def run_ladder(run_a, run_b, config: LadderConfig = LadderConfig()) -> LadderResult:
    """Fingerprints → first divergent step → traced re-runs, one level per rung → culprit → kernel rung.
    The result is saved to RUN_A/ladder/result.json (what `bitdet doctor` reads)."""
    import json

    result = _climb(run_a, run_b, config)
    if result.diverged:
        path = ladder_result_path(run_a)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_json(), indent=1))
    return result


def _climb(run_a, run_b, config: LadderConfig) -> LadderResult:
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
    specs = [_ladder_spec(run_a), _ladder_spec(run_b)]
    steps, ranks = [max(1, div.step - config.context), div.step], None
    for level in config.levels:
        for _ in range(1 + config.retries):
            outs = _relaunch_both(specs, (run_a, run_b), level, steps, ranks)
            found = localize_traces(*outs, config.localize)
            if found.mismatch:
                break
        c = found.culprit
        result.rungs.append(Rung(level, list(steps), ranks, [str(o) for o in outs], found.mismatch, c,
                                 found.events_compared))
        if not found.mismatch and found.incomplete:  # nothing after the cut was compared: not "did not reproduce"
            result.reproduced = False
            result.note = (f"incomplete: the {level} re-run's traces (steps {steps[0]}-{steps[1]}) were not compared "
                           f"to their end ({'; '.join(found.incomplete)}): the divergence at step {div.step} was "
                           "neither reproduced nor ruled out")
            return result
        if not found.mismatch:
            result.reproduced = False
            result.note = (f"intermittent: the divergence at step {div.step} did not reproduce in "
                           f"{1 + config.retries} {level} re-run(s) (steps {steps[0]}-{steps[1]}, "
                           f"ranks {'all' if ranks is None else ranks}); "
                           f"rungs tried: {', '.join(r.level for r in result.rungs)}")
            return result
        result.culprit = c
        steps = [c["step"], c["step"]]
        if c["classification"] == PRODUCER and not c.get("receivers"):
            ranks = [c["rank"]]
    result.reproduced = True
    if config.kernel:
        result.kernel = kernel_rung(specs, (run_a, run_b), result.culprit, result.rungs[-1].level, config.repeats)
    return result


def kernel_rung(specs, runs, culprit: dict, level: str, repeats: int) -> dict:
    """Capture the culprit op occurrence in both runs and replay it in isolation; or say why not."""
    from megatron_bitdet.analysis.kernel_replay import RUNTIME_CONFIG, replay_op
    from megatron_bitdet.rundir import capture_path

    cls = culprit["classification"]
    if cls == CONTROL:
        return {"status": "not_replayable", "mechanism": RUNTIME_CONFIG,
                "verdict": f"the runs executed different ops from equal inputs at step {culprit['step']} "
                           f"({culprit['evidence']}): a code path chosen at run time (autotuning, timing- or "
                           "state-based dispatch); no single op to replay"}
    if cls == BLIND_SPOT:
        return {"status": "not_replayable", "mechanism": "dispatcher_blind_spot",
                "verdict": f"{culprit['evidence']}; replay-op runs ATen and registered custom ops only: replay "
                           f"module {culprit['module'] or '(top level)'}'s own forward with captured inputs"}
    why = ("needs an op-level culprit (add op to --levels)" if level != "op" else
           f"a {cls} culprit has no op whose equal inputs give differing outputs" if cls != PRODUCER else
           "the culprit is a collective whose members all had equal inputs (its order lives in the reduction "
           "or transport, not in a replayable op)" if culprit.get("inputs") is None else None)
    if why:
        return {"status": "skipped", "mechanism": None, "verdict": f"kernel rung skipped: {why}"}
    capture = {"rank": culprit["rank"], "event_id": culprit["event_id"]}
    outs = _relaunch_both(specs, runs, "op", [culprit["step"], culprit["step"]], [culprit["rank"]],
                          capture=capture, rung="kernel")
    paths = [capture_path(o, culprit["rank"]) for o in outs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        return {"status": "not_captured", "mechanism": None,
                "verdict": f"the re-run did not reach {culprit['event_id']} ({', '.join(missing)} not written)"}
    found = replay_op(*paths, repeats=repeats)
    return {"status": "replayed", **found.to_json()}


def describe(culprit: dict) -> str:
    """One line: this op in this module on this rank at this step."""
    where = f"module {culprit['module'] or '(top level)'}"
    return (f"{culprit['op']} in {where} on rank {culprit['rank']} at step {culprit['step']} "
            f"({culprit['phase']}): {culprit['classification']} — {culprit['evidence']}")
