"""`bitdet prove`: both guarantees, demonstrated on this machine, plus what they cost.

Stages: run A (the uninterrupted reference: it also snapshots its live state after every resume
point), an independent run B, the resumed chain (against A: stop, restore, compare state and the
outputs that follow), the comparison A vs B, the determinism tax, the report. One pipeline for every
kind of run: what launches them is an object (``RecipeRuns`` for a bitdet recipe; Megatron-LM's
launch lines in ``megatron_prove``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_bitdet.analysis.report import RunSpec, Section, Verdict

REPRODUCIBILITY = "independent reproducibility (run A vs run B, every step bitwise)"
RESUME = "bitwise checkpoint resume (restored state and every later step vs run A)"
REPLICAS = "replicas agree within run A (bitdet check: data-parallel copies, step by step)"


@dataclass(frozen=True)
class ProveConfig:
    """The tax in prove is a short look (the full measurement is ``bitdet tax``). ``tax_warmup``: the
    first rounds (bitdet's loop) or the first steps of every launch (Megatron-LM) left untimed."""

    tax: bool = True
    tax_rounds: int = 4
    tax_warmup: int = 1
    tax_profile_steps: int = 1


@dataclass
class ProveResult:
    out_dir: str
    verdicts: list
    compare: object  # CompareResult, A vs B
    resume: object  # ResumeReport
    tax: object = None  # TaxResult, megatron_prove.LaunchTax or None
    tax_error: str | None = None
    report_path: str = ""
    stage_seconds: dict = field(default_factory=dict)
    tax_hint: str = ""  # how far the tax figure goes (the runs' own words)
    runs: str = ""  # what was proven, in words
    replicas_unchecked: str = ""  # why run A's replicas could not be checked (no verdict then)

    @property
    def holds(self) -> bool:
        return all(v.holds for v in self.verdicts)

    @property
    def exit_code(self) -> int:
        return 0 if self.holds else 1


def default_resume_at(iterations: int) -> list[int]:
    """iterations/3 and 2*iterations/3 (distinct, inside 1..iterations-1)."""
    return sorted({k for k in (iterations // 3, 2 * iterations // 3) if 0 < k < iterations})


def reproducibility_verdict(result) -> Verdict:
    what = (f"{result.steps_compared} steps × {len(result.ranks_compared)} ranks × "
            f"{len(result.metrics_compared)} metrics + {len(result.digests_compared)} digests")
    if result.verdict == "match":
        return Verdict(REPRODUCIBILITY, True, f"{what}: bit-identical")
    d = result.first_divergence
    first = (f"first divergence at step {d.step}: {', '.join(d.metrics)} on rank(s) "
             f"{','.join(map(str, d.ranks))}" if d else result.error or result.verdict)
    return Verdict(REPRODUCIBILITY, False, f"{what}: {first}; {len(result.diverged_steps)} differing steps")


def replica_verdict(run_a: Path) -> tuple[Verdict | None, str]:
    """(verdict, "") of ``bitdet check`` on run A, what it covered and what the layout leaves
    uncoverable its evidence; (None, why) for a run with nothing to check (one replica, only owned
    shards): no verdict is claimed for it."""
    from megatron_bitdet.analysis.replicas import check_run, coverage_summary
    from megatron_bitdet.errors import BitdetInputError

    try:
        result = check_run(run_a)
    except BitdetInputError as exc:
        return None, str(exc)
    evidence = coverage_summary(result)
    if result.verdict == "consistent":
        return Verdict(REPLICAS, True, f"all equal: {evidence}"), ""
    named = ", ".join(map(str, result.suspects))
    return Verdict(REPLICAS, False, f"{evidence}: {result.verdict}"
                   + (f", {len(result.disagreements)} disagreements, suspect rank(s) {named}" if named else
                      ": " + "; ".join(result.incomplete))), ""


def resume_verdict(report) -> Verdict:
    outputs = sum(len(p.steps_compared) for p in report.points)
    what = (f"resumed at {', '.join(map(str, report.resume_at))}: {len(report.checks)} state checks "
            f"(params, optimizer, scheduler, data, RNG × ranks), {outputs} segment steps vs run A")
    if report.holds:
        return Verdict(RESUME, True, f"{what}: all bit-identical")
    bad = [("fresh start" if not p.step else f"resumed at {p.step}") + ": "
           + (f"{', '.join(p.failing_components)} differ; " if p.failing_components else "")
           + (f"outputs first differ at step {p.first_output_divergence}" if p.first_output_divergence
              else "outputs identical")
           for p in report.points if not p.holds]
    return Verdict(RESUME, False, f"{what}: {len(report.failures)} checks differ; " + "; ".join(bad))


class _Stages:
    """The progress display: one line per stage as it starts and when it ends (the ranks' own
    console output streams in between, so no live-redrawn widget)."""

    def __init__(self, console, names):
        self.console, self.names, self.seconds = console, names, {}

    def run(self, name, fn):
        i = self.names.index(name) + 1
        self.console.rule(f"[bold]stage {i}/{len(self.names)}: {name}")
        t0 = time.perf_counter()
        value = fn()
        self.seconds[name] = round(time.perf_counter() - t0, 1)
        self.console.print(f"[green]✓[/green] {name} ({self.seconds[name]:.0f} s)")
        return value


class RecipeRuns:
    """How prove launches runs of a bitdet recipe (bitdet's own loop, ``train.run``). Any object with
    these members can be proven (``workflows.megatron_prove.MegatronRuns``: a Megatron-LM launch line)."""

    tax_hint = "a short look: `bitdet tax` / benchmarks/bench_tax.py measure longer"

    def __init__(self, recipe, *, nproc: int, model_provider: str | None = None):
        from megatron_bitdet.train.run import check_layout

        check_layout(recipe, nproc)
        self.recipe, self.nproc, self.model_provider = recipe, nproc, model_provider
        self.iterations = recipe.training.iterations

    def describe(self) -> str:
        return (f"recipe {self.recipe.name} ({self.recipe.source}) on {self.nproc} ranks, "
                f"bitdet's training loop" + (f", model provider {self.model_provider}" if self.model_provider else ""))

    def reference(self, run_dir: Path, steps: list[int]) -> None:
        from megatron_bitdet.workflows.resume import run_reference

        run_reference(self.recipe, steps, nproc=self.nproc, run_dir=run_dir, model_provider=self.model_provider)

    def independent(self, run_dir: Path) -> None:
        from megatron_bitdet.errors import BitdetError
        from megatron_bitdet.rundir import logs_dir
        from megatron_bitdet.train.run import RunOptions, launch_training

        if launch_training(self.recipe, RunOptions(nproc=self.nproc, run_dir=run_dir, save_interval=0,
                                                   model_provider=self.model_provider, fresh=True)):
            raise BitdetError(f"run B failed; logs: {logs_dir(run_dir)}")

    def resume_chain(self, steps: list[int], out_dir: Path, reference_dir: Path):
        from megatron_bitdet.workflows.resume import verify_resume

        return verify_resume(self.recipe, steps, nproc=self.nproc, out_dir=out_dir,
                             model_provider=self.model_provider, reference_dir=reference_dir)

    def tax(self, out_dir: Path, config: ProveConfig, run_a: Path, run_b: Path):
        from megatron_bitdet.workflows.tax import measure_tax

        return measure_tax(self.recipe, nproc=self.nproc, rounds=config.tax_rounds, warmup=config.tax_warmup,
                           out_dir=out_dir, profile_steps=config.tax_profile_steps, model_provider=self.model_provider)


def prove(runs, *, out_dir, resume_at=None, config: ProveConfig | None = None, console=None) -> ProveResult:
    """Run every stage of ``runs`` (:class:`RecipeRuns` or alike) under ``out_dir`` and write
    ``out_dir/report.html``."""
    from rich.console import Console

    from megatron_bitdet.analysis.compare import compare_runs
    from megatron_bitdet.errors import BitdetError
    from megatron_bitdet.workflows.resume import check_resume_at

    cfg = config or ProveConfig()
    console = console or Console()
    out = Path(out_dir)
    steps = check_resume_at(default_resume_at(runs.iterations) if resume_at is None else resume_at, runs.iterations)
    names = ["run A (reference)", "run B (independent)", "resumed runs", "comparison", "determinism tax", "report"]
    if not cfg.tax:
        names.remove("determinism tax")
    stages = _Stages(console, names)
    run_a, run_b = out / "run_a", out / "run_b"
    stages.run(names[0], lambda: runs.reference(run_a, steps))
    stages.run(names[1], lambda: runs.independent(run_b))
    resume = stages.run(names[2], lambda: runs.resume_chain(steps, out / "resume", run_a))
    ab = stages.run(names[3], lambda: compare_runs(run_a, run_b))
    replicas, unchecked = replica_verdict(run_a)
    verdicts = [reproducibility_verdict(ab), resume_verdict(resume), *([replicas] if replicas else [])]
    result = ProveResult(str(out), verdicts, ab, resume, tax_hint=runs.tax_hint, runs=runs.describe(),
                         replicas_unchecked=unchecked)
    if cfg.tax:
        try:
            result.tax = stages.run(names[4], lambda: runs.tax(out / "tax", cfg, run_a, run_b))
        except BitdetError as exc:  # the tax is a figure, not a guarantee: report it, keep the verdicts
            result.tax_error = str(exc)
    result.report_path = str(stages.run(names[-1], lambda: _render(result, run_a, run_b)))
    result.stage_seconds = stages.seconds
    return result


def _render(result: ProveResult, run_a: Path, run_b: Path) -> Path:
    from megatron_bitdet.analysis.compare import compare_runs
    from megatron_bitdet.analysis.report import render_report

    segments = [p for p in result.resume.points if p.step]
    runs = [RunSpec("run A", str(run_a)), RunSpec("run B", str(run_b))]
    runs += [RunSpec(f"resumed at {p.step}", p.run_dir, (p.step,)) for p in segments]
    compares = {"run A vs run B": result.compare}
    compares.update({f"run A vs resumed at {p.step} (steps {p.step + 1}-{p.stop})": compare_runs(
        run_a, p.run_dir, steps=range(p.step + 1, p.stop + 1)) for p in segments})
    sections = [Section("What ran", result.runs), Section("Resume validation", result.resume.summary())]
    if result.tax:
        sections.append(Section("Determinism tax: how it was measured", result.tax.summary() + "\n" +
                                "\n".join(f"- {n}" for n in result.tax.notes)))
    if result.tax_error:
        sections.append(Section("Determinism tax: not measured", result.tax_error))
    return render_report(Path(result.out_dir) / "report.html", title="bitdet prove", verdicts=result.verdicts,
                         runs=runs, compare_results=compares,
                         tax=result.tax.to_report_dict() if result.tax else None, extra_sections=sections)


def verdict_table(result: ProveResult):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="bitdet prove: verdicts")
    for col in ("guarantee", "verdict", "evidence"):
        table.add_column(col, overflow="fold")
    for v in result.verdicts:
        table.add_row(v.guarantee, "[green]holds" if v.holds else "[bold red]BROKEN", escape(v.evidence))
    if result.replicas_unchecked:
        table.add_row(REPLICAS, "not checkable", escape(result.replicas_unchecked))
    if result.tax:
        table.add_row("determinism tax (cost, not a guarantee)", f"{result.tax.tax_percent:+.1f}%",
                      escape(result.tax.summary() + "; " + result.tax_hint))
    elif result.tax_error:
        table.add_row("determinism tax", "not measured", escape(result.tax_error))
    return table
