"""``bitdet prove --megatron-lm``: the prove stages on a Megatron-LM launch line (each run a fresh
launch of the user's unmodified script, ``megatron_lm.launch``), and what the tax can honestly say there.

The tax: ``workflows.tax`` builds bitdet's own model, so it cannot time the user's script. Here the
deterministic side is run A and run B themselves and the baseline is ONE extra launch of the same
line without ``--deterministic-mode`` (no canonical environment, no torch deterministic algorithms,
Megatron's flags as given). Each step's time is the wall time of Megatron-LM's ``train_step`` on the
slowest rank (``megatron_lm.timings``), the first steps of every
launch excluded as warm-up; the figure is the median per-step ratio paired by step (same batch, same
lr) and the ratio of medians. The launches are sequential, not interleaved: a short look, not a
benchmark (load on the machine between launches moves it).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from megatron_bitdet.rundir import fresh
from megatron_bitdet.errors import BitdetError, BitdetInputError

MODE_FLAG = "--deterministic-mode"


@dataclass
class LaunchTax:
    """The determinism tax of a launch line from sequential launches (ms: the slowest rank per step)."""

    steps: list  # the timed steps (after the warm-up)
    deterministic_ms: dict  # run label -> [ms per timed step]
    baseline_ms: list
    tax_percent: float  # median deterministic step / median baseline step - 1
    paired_tax_percent: float  # median over (run, step) of det / baseline at the same step - 1
    nproc: int
    threads: dict  # side -> torch threads per rank, from the manifests
    notes: list = field(default_factory=list)

    def _all_det(self) -> list:
        return [t for times in self.deterministic_ms.values() for t in times]

    def summary(self) -> str:
        return (f"tax {self.tax_percent:+.1f}% (paired {self.paired_tax_percent:+.1f}%): deterministic "
                f"{np.median(self._all_det()):.1f} ms vs baseline {np.median(self.baseline_ms):.1f} ms per step "
                f"(median over steps {self.steps[0]}-{self.steps[-1]} of {len(self.deterministic_ms)} deterministic "
                f"launches and 1 baseline launch, {self.nproc} ranks; sequential launches, not interleaved)")

    def to_report_dict(self) -> dict:
        """The ``tax`` argument of ``analysis.report.render_report`` (step times only: no profile here)."""
        sides = {"deterministic": self._all_det(), "baseline": self.baseline_ms}
        return {"tax_percent": self.tax_percent,
                "step_time_ms": {k: {"median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
                                     "p90": float(np.percentile(v, 90))} for k, v in sides.items()}}

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "kind": "megatron-lm launches"}, indent=2)


def step_ms(run_dir, nproc: int, steps: list[int]) -> list[float]:
    """Each of ``steps``' wall time (ms) on the slowest rank; every rank must have timed every step."""
    from megatron_bitdet.megatron_lm.timings import read_step_times

    times = read_step_times(run_dir, nproc)
    for rank, by_step in times.items():
        missing = [s for s in steps if s not in by_step]
        if missing:
            raise BitdetError(f"{run_dir}: rank {rank} has no timing for step {missing[0]}")
    return [max(times[r][s] for r in times) * 1000 for s in steps]


def launch_tax(deterministic: dict, baseline, *, nproc: int, iterations: int, warmup: int) -> LaunchTax:
    """``deterministic``: label -> run dir of the deterministic launches; ``baseline``: the run dir of
    the same line without ``--deterministic-mode``."""
    from megatron_bitdet.enforce.manifest import load_manifest

    steps = list(range(warmup + 1, iterations + 1))
    if not steps:
        raise BitdetError(f"no step to time: --train-iters {iterations} leaves none after {warmup} warm-up step(s)")
    det = {label: step_ms(d, nproc, steps) for label, d in deterministic.items()}
    base = step_ms(baseline, nproc, steps)
    paired = [a / b - 1 for times in det.values() for a, b in zip(times, base)]
    all_det = [t for times in det.values() for t in times]
    threads = {side: load_manifest(d)["scope"].get("torch_threads")
               for side, d in [("deterministic", next(iter(deterministic.values()))), ("baseline", baseline)]}
    notes = [f"baseline = the same launch line without {MODE_FLAG} (one extra launch): no canonical environment, "
             f"no torch deterministic algorithms, Megatron-LM's flags as given; torch threads per rank: "
             f"deterministic {threads['deterministic']}, baseline {threads['baseline']}",
             f"deterministic = {', '.join(det)} (the launches proven above); step time = Megatron-LM's train_step "
             "on the slowest rank (bitdet's grads digest and run A's snapshots left out); "
             + (f"step{'s 1-' if warmup > 1 else ' '}{warmup} of each launch excluded as warm-up" if warmup
                else "no warm-up excluded"),
             "sequential launches, not interleaved: machine load between launches moves the figure; "
             "a short look, not a benchmark",
             "per step (ms): " + "; ".join(f"{label} {', '.join(f'{t:.1f}' for t in times)}"
                                          for label, times in [*det.items(), ("baseline", base)])]
    return LaunchTax(steps=steps, deterministic_ms=det, baseline_ms=base,
                     tax_percent=(float(np.median(all_det)) / float(np.median(base)) - 1) * 100,
                     paired_tax_percent=float(np.median(paired)) * 100, nproc=nproc, threads=threads, notes=notes)


class MegatronRuns:
    """How prove launches runs of a Megatron-LM launch line (``workflows.prove.RecipeRuns``' members)."""

    tax_hint = "a short look, not a benchmark (`bitdet tax` measures bitdet's own loop, interleaved)"

    def __init__(self, script: str, line: list, *, nproc: int, recipe: str | None = None, skip_restore=()):
        from megatron_bitdet.megatron_lm.entry import load_base_recipe, split_argv
        from megatron_bitdet.megatron_lm.launch import pasted
        from megatron_bitdet.megatron_lm.options import preparse
        from megatron_bitdet.workflows.megatron_resume import skipped_restore_flags, train_iters

        line = pasted(line, "prove")
        if recipe is not None:
            if "--recipe" in line:
                raise BitdetInputError(f"--recipe {recipe} and the launch line's --recipe both given: keep one")
            line += ["--recipe", recipe]
        if MODE_FLAG not in line:
            raise BitdetInputError(f"the launch line has no {MODE_FLAG}: prove demonstrates a deterministic run")
        self.fault_flags = skipped_restore_flags(skip_restore)
        split_argv([script])  # the script exists
        load_base_recipe(preparse(line))  # bitdet's own options on the line (and its recipe) are usable
        self.script, self.line, self.nproc, self.skip_restore = script, line, nproc, list(skip_restore)
        self.iterations = train_iters(line)

    def describe(self) -> str:
        faults = ("\nresumed launches skip a restore on purpose: " + ", ".join(
            f"{s} ({flag})" for s, flag in zip(self.skip_restore, self.fault_flags))) if self.skip_restore else ""
        return (f"Megatron-LM {self.script} on {self.nproc} ranks (bitdet megatron-lm), launch line:\n"
                f"  {' '.join(self.line)}{faults}")

    def _launch(self, run_dir: Path, argv: list, what: str) -> None:
        from megatron_bitdet.megatron_lm.launch import launch_or_fail

        fresh(run_dir)  # fingerprints and timings append: start empty
        launch_or_fail(self.script, argv, nproc=self.nproc, run_dir=run_dir, what=what)

    def reference(self, run_dir: Path, steps: list[int]) -> None:
        self._launch(run_dir, [*self.line, "--snapshot-at", ",".join(map(str, steps))], "run A")

    def independent(self, run_dir: Path) -> None:
        self._launch(run_dir, self.line, "run B")

    def resume_chain(self, steps: list[int], out_dir: Path, reference_dir: Path):
        from megatron_bitdet.workflows.megatron_resume import verify_megatron_resume

        return verify_megatron_resume(self.script, self.line, steps, nproc=self.nproc, out_dir=out_dir,
                                      skip_restore=self.skip_restore, reference_dir=reference_dir)

    def tax(self, out_dir: Path, config, run_a: Path, run_b: Path) -> LaunchTax:
        baseline = Path(out_dir) / "baseline"
        from megatron_bitdet.megatron_lm.launch import rerun_args

        # without the recipe too: a recipe asking for determinism needs the flag (entry.load_base_recipe)
        line = [a for a in rerun_args(self.line, drop=("--recipe", "--bitdet-override")) if a != MODE_FLAG]
        self._launch(baseline, line, f"baseline launch (without {MODE_FLAG})")
        result = launch_tax({"run A": run_a, "run B": run_b}, baseline, nproc=self.nproc,
                            iterations=self.iterations, warmup=config.tax_warmup)
        (Path(out_dir) / "tax.json").write_text(result.to_json())
        return result
