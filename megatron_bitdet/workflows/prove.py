"""`bitdet prove`: both guarantees, demonstrated on this machine, plus what they cost.

Stages: run A (the uninterrupted reference: it also snapshots its live state after every resume
point), an independent run B, the resumed chain (``verify_resume`` against A: stop, restore, compare
state and the outputs that follow), the comparison A vs B, the determinism tax, the report.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_bitdet.analysis.report import RunSpec, Section, Verdict

REPRODUCIBILITY = "independent reproducibility (run A vs run B, every step bitwise)"
RESUME = "bitwise checkpoint resume (restored state and every later step vs run A)"


@dataclass(frozen=True)
class ProveConfig:
    """The tax in prove is a short look (the full measurement is ``bitdet tax``)."""

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
    tax: object = None  # TaxResult | None
    tax_error: str | None = None
    report_path: str = ""
    stage_seconds: dict = field(default_factory=dict)

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


def prove(recipe, *, nproc: int, out_dir, resume_at=None, tax: bool = True, model_provider=None,
          config: ProveConfig | None = None, console=None) -> ProveResult:
    """Run every stage under ``out_dir`` and write ``out_dir/report.html``."""
    from rich.console import Console

    from megatron_bitdet.analysis.compare import compare_runs
    from megatron_bitdet.workflows.resume import check_resume_at, run_reference, verify_resume
    from megatron_bitdet.errors import BitdetError
    from megatron_bitdet.rundir import logs_dir
    from megatron_bitdet.train.run import RunOptions, check_layout, launch_training

    cfg = config or ProveConfig(tax=tax)
    console = console or Console()
    out = Path(out_dir)
    steps = check_resume_at(default_resume_at(recipe.training.iterations) if resume_at is None else resume_at,
                            recipe.training.iterations)
    check_layout(recipe, nproc)
    names = ["run A (reference)", "run B (independent)", "resumed runs", "comparison", "determinism tax", "report"]
    if not cfg.tax:
        names.remove("determinism tax")
    stages = _Stages(console, names)
    run_a, run_b = out / "run_a", out / "run_b"
    stages.run(names[0], lambda: run_reference(recipe, steps, nproc=nproc, run_dir=run_a,
                                               model_provider=model_provider))

    def _run_b():
        if launch_training(recipe, RunOptions(nproc=nproc, run_dir=run_b, save_interval=0,
                                              model_provider=model_provider, fresh=True)):
            raise BitdetError(f"run B failed; logs: {logs_dir(run_b)}")
    stages.run(names[1], _run_b)
    resume = stages.run(names[2], lambda: verify_resume(recipe, steps, nproc=nproc, out_dir=out / "resume",
                                                        model_provider=model_provider, reference_dir=run_a))
    ab = stages.run(names[3], lambda: compare_runs(run_a, run_b))
    verdicts = [reproducibility_verdict(ab), resume_verdict(resume)]
    result = ProveResult(str(out), verdicts, ab, resume)
    if cfg.tax:
        from megatron_bitdet.workflows.tax import measure_tax

        try:
            result.tax = stages.run(names[4], lambda: measure_tax(
                recipe, nproc=nproc, rounds=cfg.tax_rounds, warmup=cfg.tax_warmup, out_dir=out / "tax",
                profile_steps=cfg.tax_profile_steps, model_provider=model_provider))
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
    sections = [Section("Resume validation", result.resume.summary())]
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
    if result.tax:
        table.add_row("determinism tax (cost, not a guarantee)", f"{result.tax.tax_percent:+.1f}%",
                      escape(result.tax.summary()) + "; a short look: `bitdet tax` / benchmarks/bench_tax.py measure longer")
    elif result.tax_error:
        table.add_row("determinism tax", "not measured", escape(result.tax_error))
    return table
