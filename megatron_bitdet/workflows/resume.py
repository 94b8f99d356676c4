"""Checkpoint-resume validation: stop and restore at each K, compare the live state bit for bit,
component by component and rank by rank, then the outputs of the steps that follow.

Design: one uninterrupted reference run snapshots its live state after every K. The resumed side
is a *chain* of fresh process launches: segment 0 trains 0 -> K1 and saves; segment i loads the
previous segment's checkpoint at Ki, snapshots right after the restore and trains to K(i+1) (saving
there), the last one to the end. A chain is the stronger test than loading the reference's own
checkpoints: every save after the first is made by a process that was itself restored, so a
component that is restored but not re-saved (or saved but not restored) breaks the chain, and the
segments together cover the whole run without the reference's process ever lending state.
The reference therefore saves nothing; it only snapshots and fingerprints.

Across data-parallel sizes (``resume_nproc``): segment 0 runs at the reference's ``nproc`` and saves
there; every resumed segment runs at ``resume_nproc``, so the first restore crosses DP (the checkpoint
reshards, ``train.checkpoint``). Each resumed rank's state is compared with the reference rank whose
per-rank state it continued from (the same model-parallel coordinates, lowest DP rank), except the
distributed optimizer's shards, laid out by DP: they are not compared leaf by leaf (the report names them);
their values and Adam's moments are compared whole through the snapshots' logical digests, every rank's
partial added on each side (``compare_logical``), and the outputs of the steps after the resume are
compared on the layout-independent fingerprints of ``determinism.reductions: dp_invariant``. Without
that mode a run's bits follow its DP size, so a verdict across DP is refused for scope before any launch.

Snapshots are digest files (``train.snapshot``): per-tensor chunk digests, computed on the device, no
copy of the state on disk. A tensor whose digests differ gets its element counts from a targeted second
pass: both sides are re-run to K saving only the differing tensors in full (``--full-snapshots``
saves every tensor in the first pass instead).
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_bitdet.analysis.compare import compare_runs
from megatron_bitdet.analysis.fingerprints_io import load_run
from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.rundir import checkpoints_dir, iter_dir, logs_dir, read_result, snapshot_path

_MISSING = object()
REPORT_FILE = "verify_resume.json"


@dataclass
class StateCheck:
    """One leaf of the live state at one resume point and rank: bitwise equal or not, and how."""

    resume_step: int
    rank: int
    component: str  # parameters | optimizer | scheduler | data | rng.<generator>
    key: str
    equal: bool
    detail: str = ""
    by_digest: bool = False  # the detail rests on digests alone: no element counts (no full tensors to count)

    @property
    def ok(self) -> bool:
        return self.equal


@dataclass
class ResumePoint:
    """A segment of the chain: restored at ``step`` (0: a fresh start) and trained to ``stop``."""

    step: int
    stop: int
    run_dir: str
    state_holds: bool | None  # None for the fresh start (nothing restored)
    failing_components: list[str] = field(default_factory=list)
    steps_compared: list[int] = field(default_factory=list)
    first_output_divergence: int | None = None
    diverged_steps: list[int] = field(default_factory=list)
    divergent_metrics: list[str] = field(default_factory=list)
    divergent_ranks: list[int] = field(default_factory=list)

    @property
    def holds(self) -> bool:
        return self.state_holds is not False and self.first_output_divergence is None


@dataclass
class ResumeReport:
    recipe: str
    reference_dir: str
    out_dir: str
    resume_at: list[int]
    iterations: int
    faults: list[str]
    points: list[ResumePoint]
    checks: list[StateCheck]
    resume_nproc: int | None = None  # the resumed segments' world size, when it differs from the reference's
    not_compared: list[str] = field(default_factory=list)  # live state left out of the leaf comparison, and why

    @property
    def holds(self) -> bool:
        return all(p.holds for p in self.points)

    @property
    def first_output_divergence(self) -> dict[int, int | None]:
        """Resume step -> first step whose outputs differ from the reference (None: all equal)."""
        return {p.step: p.first_output_divergence for p in self.points if p.step}

    @property
    def failures(self) -> list[StateCheck]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> dict:
        return {**asdict(self), "holds": self.holds,
                "first_output_divergence": {str(k): v for k, v in self.first_output_divergence.items()}}

    def table(self):
        """Rich table: one row per resume point and component (failing keys named), plus outputs."""
        from rich.table import Table

        table = Table(title=f"resume validation: {self.recipe} ({self.iterations} iterations)")
        for col in ("resumed at", "component", "ranks", "leaves", "differ", "first difference"):
            table.add_column(col)
        for p in self.points:
            for component, checks in _by_component(self.checks, p.step).items():
                bad = [c for c in checks if not c.ok]
                first = f"rank {bad[0].rank} {bad[0].key}: {bad[0].detail}" if bad else ""
                table.add_row(str(p.step), component, ",".join(map(str, sorted({c.rank for c in checks}))),
                              str(len(checks)), _count_ranks(bad), first,
                              style="red" if bad else None)
            if p.first_output_divergence is None:
                outputs = f"steps {_span(p.steps_compared)} bit-identical"
            else:
                outputs = (f"first differ at step {p.first_output_divergence}: "
                           f"{', '.join(p.divergent_metrics)} on rank(s) {','.join(map(str, p.divergent_ranks))}")
            label = "fresh start" if p.step == 0 else str(p.step)
            table.add_row(label, "outputs", "", str(len(p.steps_compared)),
                          str(len(p.diverged_steps)), outputs,
                          style=None if p.first_output_divergence is None else "red", end_section=True)
        return table

    def summary(self) -> str:
        """One line per broken point naming the component, rank, key and first divergent output step."""
        left_out = f" (not compared leaf by leaf: {'; '.join(self.not_compared)})" if self.not_compared else ""
        if self.holds:
            across = f" on {self.resume_nproc} ranks" if self.resume_nproc else ""
            return (f"HOLDS: resumed at {', '.join(map(str, self.resume_at))}{across}; live state and outputs "
                    f"bit-identical to the uninterrupted run{left_out}")
        lines, broken_before = ["BROKEN:"], False
        for p in self.points:
            if p.holds:
                continue
            where = "fresh start (no restore)" if p.step == 0 else f"resume at {p.step}"
            bad = [c for c in self.failures if c.resume_step == p.step]
            firsts = {}
            for c in bad:
                firsts.setdefault(c.component, c)
            state = "; ".join(f"{c.component} differs (rank {c.rank}, {c.key}: {c.detail})" for c in firsts.values())
            out = ("outputs identical" if p.first_output_divergence is None
                   else f"outputs first differ at step {p.first_output_divergence}")
            inherited = " (after a broken segment: may be inherited)" if broken_before else ""
            lines.append(f"  {where}: {state or 'live state identical' + left_out}; {out}{inherited}")
            broken_before = True
        return "\n".join(lines)


def _by_component(checks: list[StateCheck], step: int) -> dict[str, list[StateCheck]]:
    out: dict[str, list[StateCheck]] = {}
    for c in checks:
        if c.resume_step == step:
            out.setdefault(c.component, []).append(c)
    return out


def _count_ranks(bad: list[StateCheck]) -> str:
    ranks = ",".join(map(str, sorted({c.rank for c in bad})))
    return f"{len(bad)} (rank {ranks})" if bad else "0"


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


# ----------------------------------------------------------------------------- input


def parse_resume_at(text: str) -> list[int]:
    """'2,4' -> [2, 4]; BitdetInputError for anything that is not a list of integers."""
    try:
        steps = [int(part) for part in (p.strip() for p in text.split(",")) if part]
    except ValueError:
        raise BitdetInputError(f"--resume-at: expected comma-separated iterations like '2,4', got {text!r}") from None
    if not steps:
        raise BitdetInputError(f"--resume-at: no iterations in {text!r}")
    return steps


def check_resume_at(resume_at, iterations: int) -> list[int]:
    """Strictly increasing, each in 1 .. iterations-1 (a resume at the end would test nothing)."""
    steps = list(resume_at)
    if not steps:
        raise BitdetInputError("resume_at: give at least one iteration to stop and restore at")
    for k in steps:
        if not isinstance(k, int) or isinstance(k, bool) or not 0 < k < iterations:
            raise BitdetInputError(f"resume_at: {k!r} is not an iteration in 1..{iterations - 1} "
                                   f"(training.iterations={iterations}; a resume needs steps after it)")
    for a, b in zip(steps, steps[1:]):
        if b <= a:
            raise BitdetInputError(f"resume_at: must be strictly increasing, got {a} then {b}")
    return steps


def _check_faults(faults) -> list[str]:
    from megatron_bitdet.train.snapshot import FAULTS

    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise BitdetInputError(f"unknown restore fault(s) {', '.join(map(repr, unknown))}; known: {', '.join(FAULTS)}")
    return list(faults)


# ----------------------------------------------------------------------------- runs


def _launch(recipe, run_dir: Path, what: str, **kwargs) -> Path:
    from megatron_bitdet.train.run import RunOptions, launch_training

    rc = launch_training(recipe, RunOptions(run_dir=run_dir, fresh=True, **kwargs))
    if rc != 0:
        raise BitdetError(f"{what} failed (exit code {rc}); logs: {logs_dir(run_dir)}")
    return run_dir


def run_reference(recipe, resume_at, *, nproc: int, run_dir, model_provider=None, full_snapshots: bool = False) -> Path:
    """The uninterrupted run: live-state snapshots after every resume step, no checkpoints."""
    from megatron_bitdet.train.snapshot import ALL

    steps = check_resume_at(resume_at, recipe.training.iterations)
    return _launch(recipe, Path(run_dir), "reference run", nproc=nproc, save_interval=0,
                   model_provider=model_provider, snapshot_at=steps, snapshot_full=ALL if full_snapshots else None)


def _check_reference(reference_dir: Path, recipe, resume_at: list[int], nproc: int) -> None:
    """A reused reference must be this recipe's run, hold every rank's fingerprints (unbroken) and a
    snapshot for every resume step and rank."""
    from megatron_bitdet.enforce.manifest import load_manifest
    manifest = load_manifest(reference_dir)
    if manifest["recipe_digest"] != recipe.digest():
        raise BitdetInputError(f"{reference_dir}: the reference was made from a different recipe "
                               f"(recipe_digest differs from {recipe.digest()})")
    if manifest["scope"].get("world_size") != nproc:
        raise BitdetInputError(f"{reference_dir}: the reference ran on {manifest['scope'].get('world_size')} "
                               f"ranks, not --nproc {nproc}")
    from megatron_bitdet.analysis.fingerprints_io import load_run, require_every_rank
    from megatron_bitdet.train.snapshot import check_snapshots

    require_every_rank(load_run(reference_dir, "bitdet"))  # every rank's file, whole, before any launch

    check_snapshots(reference_dir, resume_at, nproc, "rerun the reference with these resume points")


DP_INVARIANT = "dp_invariant"
# Snapshot leaves laid out by the data-parallel size: the distributed optimizer's per-param shards.
_DP_SHARDED = re.compile(r"optimizer\d+\.group\d+\.param\d+\.")
DP_SHARDED_NOTE = ("optimizer per-param shards (laid out by the data-parallel size): their values and Adam's "
                   "moments compared through the logical digests, every rank's partial added; the per-param "
                   "step counts by the outputs of the steps after the resume")


def check_other_dp(recipe, nproc: int, other: int, flag: str) -> None:
    """A bitwise verdict between ``nproc`` and ``other`` ranks needs ``dp_invariant`` reductions and a
    layout that differs in the data-parallel size alone; BitdetInputError naming ``flag`` otherwise."""
    from megatron_bitdet.train.run import check_layout

    check_layout(recipe, other)
    reductions = recipe.determinism.reductions
    if reductions != DP_INVARIANT:
        raise BitdetInputError(
            f"{flag} {other} (the run has {nproc} ranks): the recipe runs determinism.reductions={reductions}, "
            "whose sums follow the data-parallel layout, so a run continued at another data-parallel size is "
            "expected to differ and no bitwise verdict applies. Set determinism.reductions=dp_invariant "
            f"determinism.virtual_dp=V (V a multiple of both data-parallel sizes) for runs to compare, or drop {flag}")


def rank_map(recipe, nproc: int, other: int) -> list[int]:
    """For each of ``other`` ranks, the rank of an ``nproc``-rank run it continues from or compares with:
    the same model-parallel coordinates, the lowest data-parallel rank (``checkpoint.source_ranks``)."""
    from megatron_bitdet.train.checkpoint import layout, source_ranks

    saved = layout(recipe.parallel, nproc)
    return [source_ranks(saved, coords)[0] for coords in layout(recipe.parallel, other)]


def verify_resume(recipe, resume_at: list[int], *, nproc: int, out_dir, model_provider=None, faults=(),
                  reference_dir=None, full_snapshots: bool = False, resume_nproc: int | None = None) -> ResumeReport:
    """Reference run (or reuse ``reference_dir``) + a chain of resumed segments under ``out_dir``;
    ``faults`` make every restore skip those components (demonstrates detection); ``full_snapshots``:
    every snapshot also writes its tensors in full; ``resume_nproc``: the resumed segments' world size
    (module docstring), refused for scope unless the recipe runs ``dp_invariant``."""
    iterations = recipe.training.iterations
    steps = check_resume_at(resume_at, iterations)
    faults = _check_faults(faults)
    if resume_nproc == nproc:
        resume_nproc = None
    if resume_nproc is not None:
        check_other_dp(recipe, nproc, resume_nproc, "--resume-nproc")
    out_dir = Path(out_dir)
    if reference_dir is None:
        reference_dir = run_reference(recipe, steps, nproc=nproc, run_dir=out_dir / "reference",
                                      model_provider=model_provider, full_snapshots=full_snapshots)
    reference_dir = Path(reference_dir)
    _check_reference(reference_dir, recipe, steps, nproc)

    return run_chain(recipe_segment(recipe, nproc=nproc, model_provider=model_provider, faults=faults,
                                    full_snapshots=full_snapshots, resume_nproc=resume_nproc),
                     name=recipe.name, steps=steps, iterations=iterations, nproc=resume_nproc or nproc,
                     out_dir=out_dir, reference_dir=reference_dir, faults=faults,
                     reference_ranks=None if resume_nproc is None else rank_map(recipe, nproc, resume_nproc))


def recipe_segment(recipe, *, nproc: int, model_provider=None, faults=(), full_snapshots: bool = False,
                   resume_nproc: int | None = None):
    """``run_chain``'s segment launcher for ``bitdet train`` runs: a fresh launch that restores
    ``start`` (skipping ``faults``; a fresh start restores nothing), trains to ``stop`` and saves there;
    a fresh start runs on ``nproc`` ranks, a restore on ``resume_nproc`` (default ``nproc``).
    With ``full`` (a selection file) it is a second-pass run instead: it snapshots at ``stop`` (a fresh
    start) or right after restoring ``start``, keeping the selected tensors in full, and saves nothing."""
    from megatron_bitdet.train.snapshot import ALL

    iterations = recipe.training.iterations
    faults = _check_faults(faults)

    def segment(run_dir: Path, start: int, stop: int, load_from: Path | None, full=None) -> None:
        last = stop == iterations or full is not None
        _launch(recipe, run_dir, f"segment {start}->{stop}" + (" (second pass)" if full else ""),
                nproc=resume_nproc or nproc if start else nproc,
                model_provider=model_provider, save_interval=0 if last else stop, stop_at=stop,
                load=None if load_from is None else str(iter_dir(checkpoints_dir(load_from), start)),
                snapshot_at=[start or stop] if start or full else [], fault_skip_restore=faults if start else [],
                snapshot_full=str(full) if full else ALL if full_snapshots else None)

    return segment


def run_chain(segment, *, name: str, steps: list[int], iterations: int, nproc: int, out_dir: Path,
              reference_dir: Path, faults, reference_ranks: list[int] | None = None) -> ResumeReport:
    """The chain of fresh launches 0->K1->K2->...->end, each restoring the previous one's checkpoint;
    ``segment(run_dir, start, stop, load_from, full=None)`` launches one (for ``bitdet train`` or
    Megatron-LM; ``full``: a second-pass run, see ``recipe_segment``). Every restored state is compared
    with the reference's snapshot, every later step's fingerprints with the reference's. ``nproc``: the
    resumed segments' ranks; ``reference_ranks[r]``: the reference rank resumed rank r is compared with,
    when they ran at different data-parallel sizes (the DP-sharded leaves are then left out)."""
    ref_rank = (lambda r: r) if reference_ranks is None else reference_ranks.__getitem__
    bounds = [0, *steps, iterations]
    points, checks, previous = [], [], None
    for i, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        run_dir = out_dir / f"segment_{i:02d}_{start:07d}-{stop:07d}"
        segment(run_dir, start, stop, previous)
        point = ResumePoint(step=start, stop=stop, run_dir=str(run_dir), state_holds=None)
        if start:
            point_checks = [c for rank in range(nproc) for c in compare_snapshots(
                reference_dir, run_dir, start, rank, ref_rank=ref_rank(rank), dp_sharded=reference_ranks is not None)]
            if reference_ranks is not None:
                point_checks += compare_logical(reference_dir, run_dir, start, world=nproc)
            count_differences(segment, point_checks, reference_dir=reference_dir, run_dir=run_dir, load_from=previous,
                              step=start, where=out_dir / f"second_pass_{start:07d}", ref_rank=ref_rank)
            checks += point_checks
            point.state_holds = all(c.ok for c in point_checks)
            point.failing_components = list(dict.fromkeys(c.component for c in point_checks if not c.ok))
        _compare_outputs(reference_dir, run_dir, point)
        points.append(point)
        previous = run_dir
    report = ResumeReport(recipe=name, reference_dir=str(reference_dir), out_dir=str(out_dir),
                          resume_at=steps, iterations=iterations, faults=list(faults), points=points, checks=checks,
                          resume_nproc=None if reference_ranks is None else nproc,
                          not_compared=[] if reference_ranks is None else [DP_SHARDED_NOTE])
    (out_dir / REPORT_FILE).write_text(json.dumps(report.to_json(), indent=1))
    return report


def load_resume_report(out_dir) -> dict | None:
    """A saved verify-resume report (what `bitdet doctor` reads), or None when there is none."""
    path = Path(out_dir) / REPORT_FILE
    data = read_result(path, "verify-resume report", ("points", "holds"))
    if data is None:
        return None
    points = data["points"]
    if not isinstance(points, list) or not points or not all(isinstance(p, dict) for p in points):
        raise BitdetInputError(f"{path}: not a verify-resume report (points is not a non-empty list of objects)")
    if type(data["holds"]) is not bool:
        raise BitdetInputError(f"{path}: not a verify-resume report ('holds' is {data['holds']!r}, not true or false)")
    for i, p in enumerate(points):
        step, failing, first = p.get("step"), p.get("failing_components"), p.get("first_output_divergence")
        steps = p.get("steps_compared")
        if (type(step) is not int or step < 0 or not isinstance(failing, list)
                or not all(isinstance(c, str) for c in failing) or not (first is None or type(first) is int)
                or not isinstance(steps, list) or not all(type(s) is int for s in steps)):
            raise BitdetInputError(f"{path}: points[{i}] is not a resume point (step, failing_components, "
                                   "first_output_divergence, steps_compared)")
        if data["holds"] and (failing or first is not None or p.get("state_holds") is False or not steps):
            raise BitdetInputError(f"{path}: says the resume holds, but points[{i}] (resumed at {step}) does not: "
                                   "the report contradicts itself")
    if data["holds"] and not any(p["step"] for p in points):
        raise BitdetInputError(f"{path}: says the resume holds, but no point resumed from a checkpoint")
    return data


def _compare_outputs(reference_dir: Path, run_dir: Path, point: ResumePoint) -> None:
    """Fingerprints of the segment's own steps against the same steps of the reference. The segment
    must hold exactly those steps: one that also ran steps up to its resume point restored nothing
    (it trained from scratch, as a launch whose --load found no checkpoint does)."""
    expected = list(range(point.step + 1, point.stop + 1))
    ran = {rank: run.steps(rank) for run in [load_run(run_dir)] for rank in run.ranks}
    wrong = {rank: steps for rank, steps in ran.items() if steps != expected}
    if wrong:
        rank, steps = next(iter(wrong.items()))
        raise BitdetError(f"{run_dir}: the segment resumed at step {point.step} but rank {rank}'s fingerprints "
                          f"hold steps {_span(steps)}, expected {_span(expected)}"
                          + (": it ran steps before its resume point, so nothing was restored" if steps
                             and steps[0] <= point.step else ""))
    result = compare_runs(reference_dir, run_dir, steps=expected)
    point.steps_compared = [s.step for s in result.per_step]
    if point.steps_compared != expected or result.lengths_differ:
        raise BitdetError(f"{run_dir}: segment fingerprints cover steps {_span(point.steps_compared)} "
                          f"(+{result.steps_only_in_b} not in the reference), expected {_span(expected)}")
    if result.first_divergence is not None:
        point.first_output_divergence = result.first_divergence.step
        point.diverged_steps = result.diverged_steps
        point.divergent_metrics = result.first_divergence.metrics
        point.divergent_ranks = result.first_divergence.ranks


# ----------------------------------------------------------------------------- state comparison


def compare_snapshots(reference_dir, resumed_dir, step: int, rank: int, *, ref_rank: int | None = None,
                      dp_sharded: bool = False) -> list[StateCheck]:
    """Every leaf of the two snapshots at ``step`` for ``rank`` (the reference's ``ref_rank``, default the
    same), compared bitwise (tensors by their chunk digests: a tensor that differs is ``by_digest`` until
    ``count_differences`` counts it); ``dp_sharded``: leave out the leaves laid out by the DP size."""
    from megatron_bitdet.train.snapshot import read_snapshot

    ref, res = (read_snapshot(snapshot_path(d, step, r)).leaves
                for d, r in ((reference_dir, rank if ref_rank is None else ref_rank), (resumed_dir, rank)))
    # the partial logical digests: only their sums over the ranks are compared (``compare_logical``, across
    # DP); at one DP size the leaves they digest are compared one by one
    ref, res = ({leaf: v for leaf, v in side.items() if leaf[0] != "logical"
                 and not (dp_sharded and leaf[0] == "optimizer" and _DP_SHARDED.match(leaf[1]))}
                for side in (ref, res))
    checks = []
    for component, key in dict.fromkeys([*ref, *res]):
        a, b = ref.get((component, key), _MISSING), res.get((component, key), _MISSING)
        equal, detail = bitwise_equal(a, b)
        by_digest = not equal and _same_layout(a, b)
        checks.append(StateCheck(step, rank, component, key, equal, detail, by_digest))
    return checks


def compare_logical(reference_dir, resumed_dir, step: int, *, world: int) -> list[StateCheck]:
    """Across data-parallel sizes: the snapshots' ``logical`` partials at ``step`` (params, main params,
    Adam's ``exp_avg`` / ``exp_avg_sq``), every rank's added on each side (the reference's world from
    its manifest, ``world`` resumed ranks), one check per name: the distributed optimizer's shards,
    which no leaf of one rank matches at another DP size, compared whole."""
    from megatron_bitdet.enforce.manifest import load_manifest
    from megatron_bitdet.fingerprint.logical import combine_partials
    from megatron_bitdet.train.snapshot import read_snapshot

    sides = []
    for where, n in ((reference_dir, load_manifest(reference_dir)["scope"]["world_size"]), (resumed_dir, world)):
        parts: dict[str, list] = {}
        for rank in range(n):
            for (component, key), value in read_snapshot(snapshot_path(where, step, rank)).leaves.items():
                if component == "logical":
                    parts.setdefault(key, []).append(value)
        sides.append({key: combine_partials(values) for key, values in parts.items()})
    checks = []
    for key in dict.fromkeys([*sides[0], *sides[1]]):
        equal, detail = bitwise_equal(sides[0].get(key, _MISSING), sides[1].get(key, _MISSING))
        checks.append(StateCheck(step, 0, "logical", f"{key} (every rank's partial added)", equal, detail))
    return checks


def _same_layout(a, b) -> bool:
    from megatron_bitdet.train.snapshot import TensorDigest

    return isinstance(a, TensorDigest) and isinstance(b, TensorDigest) and (a.dtype, a.shape) == (b.dtype, b.shape)


def count_differences(segment, checks: list[StateCheck], *, reference_dir: Path, run_dir: Path, load_from, step: int,
                      where: Path, ref_rank=lambda r: r) -> None:
    """Element counts for the tensors whose digests differ, from full tensors: the snapshots' own
    (``--full-snapshots``) where both sides kept them, else a targeted second pass under ``where`` that
    re-runs the reference to ``step`` and the restore of ``step`` (``segment(..., full=...)``), each
    keeping only those tensors in full. A re-run whose digest is not its first run's gets no counts."""
    from megatron_bitdet.rundir import snapshot_full_path
    from megatron_bitdet.train.snapshot import read_full, read_snapshot, write_selection

    pending = [c for c in checks if c.by_digest]
    if not pending:
        return
    sides = (reference_dir, run_dir)
    rerun = not all(snapshot_full_path(d, step, r).is_file() for c in pending
                    for d, r in zip(sides, (ref_rank(c.rank), c.rank)))
    if rerun:
        selection = write_selection(where / "selection.json", [(c.component, c.key) for c in pending])
        sides = (where / "reference", where / "resumed")
        segment(sides[0], 0, step, None, full=selection)
        segment(sides[1], step, step, load_from, full=selection)
    for rank in sorted({c.rank for c in pending}):
        ranks = (ref_rank(rank), rank)
        full = [read_full(snapshot_full_path(d, step, r)) for d, r in zip(sides, ranks)]
        if rerun:
            first, again = ([read_snapshot(snapshot_path(d, step, r)).leaves for d, r in zip(dirs, ranks)]
                            for dirs in ((reference_dir, run_dir), sides))
        for c in (c for c in pending if c.rank == rank):
            leaf = (c.component, c.key)
            if rerun and any(x.get(leaf) != y.get(leaf) for x, y in zip(first, again)):
                c.detail += "; the second pass did not reproduce these digests, so no element counts"
                continue
            if not all(leaf in f for f in full):
                raise BitdetError(f"{sides[0]} / {sides[1]}: the full snapshots of step {step} rank {rank} lack "
                                  f"{c.component} {c.key}")
            c.equal, c.detail = bitwise_equal(full[0][leaf], full[1][leaf])
            c.by_digest = False


_INT_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def bitwise_equal(a, b) -> tuple[bool, str]:
    """Tensors: same dtype, shape and bytes; tensor digests: same dtype, shape and chunk digests.
    Python values: same type and value (floats by bit pattern)."""
    import torch

    from megatron_bitdet.train.snapshot import TensorDigest

    if a is _MISSING or b is _MISSING:
        return False, f"missing in the {'reference' if a is _MISSING else 'resumed run'}"
    if isinstance(a, TensorDigest) and isinstance(b, TensorDigest):
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return False, f"{a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        chunks = a.differing_chunks(b)
        return not chunks, a.describe(chunks) if chunks else ""
    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return False, f"{type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return False, f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        return _tensor_bits_equal(a, b)
    if type(a) is not type(b):
        return False, f"{a!r} ({type(a).__name__}) vs {b!r} ({type(b).__name__})"
    if isinstance(a, float):
        same = struct.pack("<d", a) == struct.pack("<d", b)
        return same, "" if same else f"{a!r} vs {b!r} (bit patterns differ)"
    return a == b, "" if a == b else f"{a!r} vs {b!r}"


def _tensor_bits_equal(a, b) -> tuple[bool, str]:
    import torch

    flat_a, flat_b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    size = flat_a.element_size()
    as_int = getattr(torch, _INT_OF_SIZE.get(size, "uint8"))
    bits_a, bits_b = (t.view(torch.uint8).view(as_int) for t in (flat_a, flat_b))
    differ = bits_a != bits_b
    if size not in _INT_OF_SIZE:  # e.g. complex128: compare byte groups per element
        differ = differ.view(-1, size).any(dim=1)
    count = int(differ.sum())
    if not count:
        return True, ""
    first = int(differ.nonzero()[0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), a.shape)) if a.dim() else ()
    return False, (f"{count} of {flat_a.numel()} elements differ; first at {list(index)}: "
                   f"{flat_a[first].item()!r} vs {flat_b[first].item()!r}")
