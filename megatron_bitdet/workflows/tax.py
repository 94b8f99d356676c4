"""The determinism tax: the deterministic recipe vs the fastest supported nondeterministic recipe.

    tax = (median deterministic step time / median baseline step time - 1) x 100%

Measured in ONE launch of N ranks: each rank builds the deterministic model and every baseline
candidate (same model, batch, layout, precision, seeds, batches), then runs rounds of one step per
side, alternating the order (A B C, C B A, ...); warm-up rounds are excluded. A round's step time is
the slowest rank's (every rank starts the step's clock after a barrier). The baseline is the fastest
candidate: determinism.mode=false with each MoE expert implementation the stack supports.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.rundir import logs_dir

# The deterministic recipe with c10d's reductions: what the topology-invariant ones cost on their own.
NATIVE_REDUCTIONS = "deterministic[native reductions]"
WORKER = "megatron_bitdet.workflows.tax_worker:tax_worker"
QUIET_PROFILER = {"KINETO_LOG_LEVEL": "6"}  # above every kineto level: no "profiler_start" lines per session


@dataclass(frozen=True)
class TaxConfig:
    """How long to measure: ``rounds`` timed rounds after ``warmup``, then ``profile_steps`` per side."""

    rounds: int = 20
    warmup: int = 3
    profile_steps: int = 2

    def __post_init__(self):
        if self.rounds < 2 or self.warmup < 0 or self.profile_steps < 1:
            raise BitdetInputError(f"tax needs rounds >= 2, warmup >= 0, profile steps >= 1 (got {self})")


@dataclass
class SideStats:
    """One configuration's figures (ms, MiB) over the timed rounds."""

    name: str
    deterministic: bool
    expert_impl: str | None
    step_ms: list
    median_ms: float
    p10_ms: float
    p90_ms: float
    tokens_per_s: float
    comm_ms: float
    peak_memory_mib: float
    op_groups_ms: dict
    top_ops_ms: dict  # rank 0's costliest ops (self time, ms/step), for saying what dominates
    det_algorithms_enabled: list  # torch.are_deterministic_algorithms_enabled() seen during its steps, all ranks
    invariant_reductions: list  # whether topology-invariant reductions were bound during its steps, all ranks
    op_calls: dict = field(default_factory=dict)  # rank 0's calls per step of every op: work, not time


@dataclass
class TaxResult:
    deterministic: SideStats
    baseline: SideStats
    candidates: list
    tax_percent: float
    paired_tax_percent: float  # median over rounds of (det / baseline - 1): robust to drift between rounds
    nproc: int
    threads: int
    config: TaxConfig
    phases_s: dict = field(default_factory=dict)  # rank 0's seconds from start to: built, rounds, profiled
    notes: list = field(default_factory=list)
    reductions_percent: float | None = None  # invariant vs native reductions, paired (None: not measured)
    reductions_label: str = "topology-invariant reductions"  # which invariant reductions (dp_invariant: its layout)

    @property
    def dominant(self) -> str:
        """The op group whose time grew the most from baseline to deterministic."""
        d, b = self.deterministic.op_groups_ms, self.baseline.op_groups_ms
        deltas = {g: d.get(g, 0.0) - b.get(g, 0.0) for g in set(d) | set(b)}
        g = max(deltas, key=deltas.get) if deltas else None
        return f"{g} (+{deltas[g]:.2f} ms/step)" if g and deltas[g] > 0 else "no op group grew"

    def to_report_dict(self) -> dict:
        """The ``tax`` argument of ``analysis.report.render_report``."""
        sides = {"deterministic": self.deterministic, "baseline": self.baseline}
        return {
            "tax_percent": self.tax_percent,
            "step_time_ms": {k: {"median": s.median_ms, "p10": s.p10_ms, "p90": s.p90_ms} for k, s in sides.items()},
            "op_groups_ms": {k: s.op_groups_ms for k, s in sides.items()},
            "comm_ms": {k: s.comm_ms for k, s in sides.items()},
            "peak_memory_mib": {k: s.peak_memory_mib for k, s in sides.items()},
        }

    def to_json(self) -> str:
        d = asdict(self)
        d["dominant"] = self.dominant
        return json.dumps(d, indent=2)

    def summary(self) -> str:
        b = self.baseline
        return (f"tax {self.tax_percent:+.2f}% (paired {self.paired_tax_percent:+.2f}%): deterministic "
                f"{self.deterministic.median_ms:.1f} ms vs {b.name} {b.median_ms:.1f} ms per step, "
                f"{self.config.rounds} rounds on {self.nproc} ranks x {self.threads} threads; grew most: {self.dominant}"
                + (f"; {self.reductions_label} {self.reductions_percent:+.2f}% (paired)"
                   if self.reductions_percent is not None else ""))


def candidates(recipe) -> list[dict]:
    """Every side to build: the deterministic recipe first, then the nondeterministic candidates (each
    rank picks the sides' patch sets itself, once the CPU seams let megatron's layer modules import).

    A side is {"name", "recipe" (dict), "deterministic" (torch's flag)} plus, optionally, "swaps"
    (bitdet's kernel swaps; default: the deterministic flag), "without_patches" (patch ids the recipe
    would get that this side runs without), "fill_uninitialized_memory" (torch's NaN-fill; default:
    the run recipe's) and "upstream_mode" (megatron's own deterministic mode of the installed version,
    ``compat.upstream_determinism``, sets torch's flag before each of its steps)."""
    sides = [{"name": "deterministic", "recipe": recipe.to_dict(), "deterministic": True}]
    if recipe.determinism.reductions != "native":
        d = recipe.to_dict()
        d["determinism"].update(reductions="native", virtual_dp=None)
        sides.append({"name": NATIVE_REDUCTIONS, "recipe": d, "deterministic": True})
    moe = recipe.model.has("E")
    impls = ["sequential", "grouped"] + (["te_grouped"] if _on_cuda() else []) if moe else [None]
    for impl in impls:
        d = recipe.to_dict()
        d["determinism"]["mode"] = False
        d["determinism"].update(reductions="native", virtual_dp=None)  # the fastest: c10d's reductions
        if impl:
            d["model"]["moe"]["expert_impl"] = impl
        sides.append({"name": f"baseline[{impl}]" if impl else "baseline", "recipe": d, "deterministic": False})
    return sides


def _pct(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q))


def _stats(side: dict, per_rank: list[dict], tokens_per_step: int) -> SideStats:
    step = [max(r["step_s"][i] for r in per_rank) * 1000 for i in range(len(per_rank[0]["step_s"]))]
    comm = [c * 1000 for r in per_rank for c in r["comm_s"]]
    peak = [max(r["peak_mib"][i] for r in per_rank) for i in range(len(per_rank[0]["peak_mib"]))]
    groups = sorted({g for r in per_rank for g in r["op_groups_ms"]})
    median = float(np.median(step))
    return SideStats(
        name=side["name"], deterministic=side["deterministic"],
        expert_impl=side["recipe"]["model"]["moe"]["expert_impl"] if "E" in side["recipe"]["model"]["hybrid_pattern"] else None,
        step_ms=step, median_ms=median, p10_ms=_pct(step, 10), p90_ms=_pct(step, 90),
        tokens_per_s=tokens_per_step / (median / 1000), comm_ms=float(np.median(comm)),
        peak_memory_mib=float(np.median(peak)),
        op_groups_ms={g: float(np.mean([r["op_groups_ms"].get(g, 0.0) for r in per_rank])) for g in groups},
        top_ops_ms=per_rank[0]["top_ops_ms"], op_calls=per_rank[0]["op_calls"],
        det_algorithms_enabled=sorted({f for r in per_rank for f in r["det_flag_seen"]}),
        invariant_reductions=sorted({f for r in per_rank for f in r["invariant_seen"]}),
    )


def run_sides(recipe, sides: list, *, nproc: int, config: "TaxConfig", out_dir, model_provider: str | None = None):
    """Build ``sides`` (see :func:`candidates`) on every rank of ONE launch and alternate their steps.

    Returns (stats per side, in order; threads per rank; rank 0's phase seconds)."""
    from megatron_bitdet.train.launch import launch
    from megatron_bitdet.train.run import check_layout, child_env

    check_layout(recipe, nproc)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / "tax_raw.json"
    raw.unlink(missing_ok=True)
    rc = launch(WORKER, nproc, {"recipe": recipe.to_dict(), "sides": sides, "rounds": config.rounds,
                                "warmup": config.warmup, "profile_steps": config.profile_steps, "out_path": str(raw),
                                "model_provider": model_provider},
                run_dir=out_dir, env={**child_env(recipe), **QUIET_PROFILER}, console_rank=-1)
    if rc != 0 or not raw.exists():  # a rank that refused its input (exit 2) makes the measurement's exit 2
        raise (BitdetInputError if rc == 2 else BitdetError)(
            f"tax measurement failed (exit {rc}); rank logs: {logs_dir(out_dir)}")
    data = json.loads(raw.read_text())
    t = recipe.training
    tokens = t.global_batch_size * recipe.model.seq_length
    stats = [_stats(side, [rank[i] for rank in data["ranks"]], tokens) for i, side in enumerate(sides)]
    return stats, data["threads"], data["phases_s"]


def reductions_label(recipe, nproc: int) -> str:
    """What the deterministic side's reductions are, for the tax's notes and summary."""
    d, p = recipe.determinism, recipe.parallel
    if d.reductions != "dp_invariant":
        return "topology-invariant reductions"
    hosted = d.virtual_dp // max(1, nproc // (p.tensor * p.pipeline * p.context))
    return (f"dp_invariant reductions (virtual_dp {d.virtual_dp}, {hosted} virtual rank(s) per rank: "
            f"{hosted.bit_length() - 1} extra grad buffer(s))")


def with_measured_batches(recipe, config: "TaxConfig"):
    """``recipe`` with exactly the iterations the rounds consume (the batches every side sees)."""
    from megatron_bitdet.recipe import Recipe

    d = recipe.to_dict()
    d["training"]["iterations"] = config.warmup + config.rounds + config.profile_steps
    return Recipe.from_dict(d, source=getattr(recipe, "source", "<recipe>"))


def measure_tax(recipe, *, nproc: int, rounds: int = 20, warmup: int = 3, out_dir=None, profile_steps: int = 2,
                model_provider: str | None = None, against=None, against_provider: str | None = None) -> TaxResult:
    """Measure the tax of ``recipe`` (determinism.mode must be true) on ``nproc`` local ranks.

    ``against``: measure ``recipe`` against that one recipe (with ``against_provider``) instead of the
    nondeterministic candidates: a fix's cost, the fixed configuration vs the original one."""
    cfg = TaxConfig(rounds=rounds, warmup=warmup, profile_steps=profile_steps)
    if against is None and not recipe.determinism.mode:
        raise BitdetInputError("the tax compares the deterministic recipe with a baseline: "
                               "determinism.mode must be true (the baseline is derived from it)")
    recipe = with_measured_batches(recipe, cfg)
    if against is None:
        sides = candidates(recipe)
    else:
        sides = [{"name": "fixed", "recipe": recipe.to_dict(), "deterministic": recipe.determinism.mode,
                  "model_provider": model_provider},
                 {"name": "original", "recipe": with_measured_batches(against, cfg).to_dict(),
                  "deterministic": against.determinism.mode, "model_provider": against_provider}]
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="bitdet_tax_"))
    stats, threads, phases = run_sides(recipe, sides, nproc=nproc, config=cfg, out_dir=out_dir,
                                       model_provider=model_provider)
    det, others = stats[0], stats[1:]
    native = next((s for s in others if s.name == NATIVE_REDUCTIONS), None)
    base = min((s for s in others if s is not native), key=lambda s: s.median_ms)
    notes = [(f"baseline = fastest nondeterministic candidate: {base.name} "
              f"(candidates: {', '.join(f'{c.name} {c.median_ms:.2f} ms' for c in others)})") if against is None
             else "baseline = the original (unfixed) configuration; the fixed one is measured against it",
             "one launch: every rank builds all sides and alternates their steps on the same batches; "
             "process-wide determinism env vars apply to every side",
             "peak memory: " + ("CUDA allocator peak per step" if det.peak_memory_mib and _on_cuda()
                                else "process RSS high-water per step (VmHWM reset via /proc/self/clear_refs; "
                                     "includes all sides' resident models: compare by difference)")]
    paired = float(np.median([a / b - 1 for a, b in zip(det.step_ms, base.step_ms)]) * 100)
    reductions_pct = None
    if native is not None:
        reductions_pct = float(np.median([a / b - 1 for a, b in zip(det.step_ms, native.step_ms)]) * 100)
        notes.append(f"{reductions_label(recipe, nproc)}: {reductions_pct:+.2f}% a step (paired) against the same "
                     f"deterministic recipe with c10d's reductions ({native.median_ms:.2f} ms); peak memory "
                     f"{det.peak_memory_mib - native.peak_memory_mib:+.1f} MiB")
    result = TaxResult(deterministic=det, baseline=base, candidates=others,
                       tax_percent=(det.median_ms / base.median_ms - 1) * 100, paired_tax_percent=paired,
                       nproc=nproc, threads=threads, config=cfg, phases_s=phases, notes=notes,
                       reductions_percent=reductions_pct, reductions_label=reductions_label(recipe, nproc))
    (out_dir / "tax.json").write_text(result.to_json())
    return result


def tax_table(result):
    """Rich table: one column per configuration, the baseline marked."""
    from rich.markup import escape
    from rich.table import Table

    sides = [result.deterministic, *result.candidates]
    table = Table(title=f"determinism tax: {result.tax_percent:+.2f}%  (paired {result.paired_tax_percent:+.2f}%)")
    table.add_column("")
    for s in sides:
        table.add_column(escape(s.name) + (" ◀ baseline" if s is result.baseline else ""), justify="right")
    rows = [
        ("step time median (ms)", lambda s: f"{s.median_ms:.2f}"),
        ("p10 – p90 (ms)", lambda s: f"{s.p10_ms:.1f} – {s.p90_ms:.1f}"),
        ("tokens/s", lambda s: f"{s.tokens_per_s:,.0f}"),
        ("comm time median (ms)", lambda s: f"{s.comm_ms:.2f}"),
        ("peak memory (MiB)", lambda s: f"{s.peak_memory_mib:.1f}"),
        ("torch deterministic algorithms", lambda s: "/".join(map(str, s.det_algorithms_enabled))),
    ]
    groups = sorted({g for s in sides for g in s.op_groups_ms})
    rows += [(f"  {g} (ms, profiled)", lambda s, g=g: f"{s.op_groups_ms.get(g, 0.0):.2f}") for g in groups]
    for label, fn in rows:
        table.add_row(label, *[fn(s) for s in sides])
    return table


def print_tax(result, console) -> None:
    """Table, notes and summary (names like ``baseline[grouped]`` escaped from rich markup)."""
    from rich.markup import escape

    console.print(tax_table(result))
    for note in result.notes:
        console.print(f"• {escape(note)}")
    console.print(escape(result.summary()))


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
