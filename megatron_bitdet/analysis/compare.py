"""Step-by-step, rank-by-rank, bit-exact comparison of two runs' fingerprints.

The first differing step localizes a problem; everything after it is summarized, because a
divergence propagates. Two runs are only comparable inside one validation scope, so the
manifests' scopes are diffed first and a mismatch is refused unless forced.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_bitdet.analysis.fingerprints_io import load_run, require_every_rank
from megatron_bitdet.analysis.run_data import RunData
from megatron_bitdet.enforce.manifest import scope_diff
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.floatbits import decode_float, first_differing_bit, ulp_distance
from megatron_bitdet.fingerprint.logical import combine_partials
from megatron_bitdet.fingerprint.steps import DIGEST_PREFIX, StepRecord

# What dp_invariant runs with the same virtual_dp may differ in: their data-parallel size.
DP_LAYOUT_KEYS = ("dp", "world_size")
# Digests of DDP buffers as laid out on a rank: meaningless across data-parallel sizes.
LAYOUT_DIGESTS = ("params", "grads", "main_params")

# "incomplete": the common steps agree, but a step (of the ones asked for) is missing from one run,
# so the runs were not compared in full: never a match.
EXIT_CODES = {"match": 0, "diverged": 1, "incomplete": 1, "unusable": 2}


class ScopeMismatchError(BitdetInputError):
    """The two runs were made in different validation scopes: a bitwise comparison means nothing."""

    def __init__(self, mismatches: list[dict]):
        self.mismatches = mismatches
        rows = "\n".join(f"  {m['key']}: A={m['a']!r}  B={m['b']!r}" for m in mismatches)
        super().__init__(
            f"the runs' validation scopes differ ({len(mismatches)} key(s)); a bitwise comparison "
            f"across scopes is meaningless. Pass --force to compare anyway.\n{rows}"
        )


@dataclass
class MetricDiff:
    """One differing value at one rank: both encodings, both values, and how far apart in bits."""

    rank: int
    name: str
    a: str | None
    b: str | None
    a_value: float | None = None
    b_value: float | None = None
    ulp: int | None = None
    first_bit: int | None = None  # from the most significant bit, 0 = sign
    note: str = ""


@dataclass
class Divergence:
    step: int
    metrics: list[str]
    ranks: list[int]
    details: list[MetricDiff]


@dataclass
class StepSummary:
    """Per step: max ULP distance across ranks per numeric metric (None: not comparable) and what differs."""

    step: int
    max_ulp: dict[str, int | None]
    differing: list[str]


@dataclass
class CompareResult:
    verdict: str  # "match" | "diverged" | "incomplete" | "unusable"
    run_a: str
    run_b: str
    format: str = ""
    first_divergence: Divergence | None = None
    per_step: list[StepSummary] = field(default_factory=list)
    scope_mismatches: list[dict] = field(default_factory=list)
    steps_compared: int = 0
    ranks_compared: list[int] = field(default_factory=list)
    metrics_compared: list[str] = field(default_factory=list)
    digests_compared: list[str] = field(default_factory=list)
    steps_only_in_a: list[int] = field(default_factory=list)
    steps_only_in_b: list[int] = field(default_factory=list)
    steps_in_neither: list[int] = field(default_factory=list)  # asked for (``steps``) or a gap, in neither run
    truncated: list[str] = field(default_factory=list)  # files read only up to a cut (--allow-truncated)
    diverged_steps: list[int] = field(default_factory=list)
    forced: bool = False
    warnings: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    @property
    def lengths_differ(self) -> bool:
        return bool(self.steps_only_in_a or self.steps_only_in_b or self.steps_in_neither)

    def missing_steps(self) -> str:
        """'only in A: 5-6; only in B: none[; in neither: 3]' (what made the lengths differ)."""
        return (f"only in A: {step_ranges(self.steps_only_in_a) or 'none'}; "
                f"only in B: {step_ranges(self.steps_only_in_b) or 'none'}"
                + (f"; in neither: {step_ranges(self.steps_in_neither)}" if self.steps_in_neither else ""))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def unusable(cls, run_a, run_b, error: BitdetInputError) -> CompareResult:
        """The result the CLI prints for input that could not be compared."""
        return cls(verdict="unusable", run_a=str(run_a), run_b=str(run_b), error=str(error),
                   scope_mismatches=getattr(error, "mismatches", []))


def compare_runs(run_a, run_b, *, force: bool = False, metrics=None, ranks=None,
                 fmt: str = "auto", allow_truncated: bool = False, steps=None) -> CompareResult:
    """Compare two runs (run dirs or TensorBoard dirs); BitdetInputError if they can't be compared.
    ``steps``: compare only these steps (each must be in both runs); default: every step of either run,
    and (bitdet format: a line per step) every step between a rank's first and last. A match needs
    every such step in both runs; otherwise the verdict is "incomplete"."""
    a = load_run(run_a, fmt, allow_truncated=allow_truncated)
    b = load_run(run_b, fmt, allow_truncated=allow_truncated)
    if a.format != b.format:
        raise BitdetInputError(f"cannot compare a {a.format} run ({a.path}) with a {b.format} run ({b.path})")
    result = CompareResult(verdict="match", run_a=str(a.path), run_b=str(b.path), format=a.format,
                           forced=force, warnings=a.warnings + b.warnings)
    result.scope_mismatches = _check_scope(a, b, force, result.warnings)
    if _across_dp(a, b):
        if ranks is not None:
            raise BitdetInputError("--ranks: runs of different data-parallel sizes are compared as one logical "
                                   "rank (dp_invariant); leave --ranks out")
        width = max(a.manifest["scope"]["world_size"], b.manifest["scope"]["world_size"])
        a, b = _logical_view(a, width), _logical_view(b, width)
        result.warnings.append(
            f"data-parallel sizes differ ({a.manifest['scope']['dp']} vs {b.manifest['scope']['dp']}), both "
            f"dp_invariant with virtual_dp {virtual_dp(a)}: compared every rank's metrics (rank r with the "
            "other run's rank r, or its rank 0 where it has fewer ranks) and the logical digests (the ranks' "
            "partials added); the per-rank buffer digests and slice records are layout-dependent")
    result.ranks_compared = _select_ranks(a, b, ranks)
    names = _select_names(a, b, result.ranks_compared, metrics)
    result.metrics_compared = [n for n in names if not n.startswith(DIGEST_PREFIX)]
    result.digests_compared = [n.removeprefix(DIGEST_PREFIX) for n in names if n.startswith(DIGEST_PREFIX)]
    _compare_steps(a, b, names, result, None if steps is None else set(steps))
    result.truncated = [str(f) for f in a.truncated + b.truncated]
    if result.verdict == "match" and result.truncated:
        result.verdict = "incomplete"  # what followed the cut was never compared
    return result


def virtual_dp(run: RunData) -> int | None:
    """The run's ``determinism.virtual_dp`` when it ran ``dp_invariant`` (None otherwise)."""
    d = ((run.manifest or {}).get("recipe") or {}).get("determinism") or {}
    return d.get("virtual_dp") if d.get("reductions") == "dp_invariant" else None


def _across_dp(a: RunData, b: RunData) -> bool:
    """Both runs dp_invariant with the same V, at different data-parallel sizes."""
    return (a.format == "bitdet" and virtual_dp(a) is not None and virtual_dp(a) == virtual_dp(b)
            and a.manifest["scope"].get("dp") != b.manifest["scope"].get("dp"))


def _logical_view(run: RunData, width: int) -> RunData:
    """The run on ``width`` ranks (the larger of two runs' world sizes). Its logical metrics: each as the
    lowest rank holding it writes it (the scalars are reduced: every DP rank of a dp_invariant run holds
    the same; the loss only on the last pipeline stage). Rank r holds rank r's own metrics, the logical
    ones for the names it lacks, or only the logical ones where the run has fewer ranks, so every rank's
    metrics are compared with the other run's. Rank 0 also holds the step's layout-free digests: the
    ranks' logical partials added, and rank 0's small-state digests (module buffers, generators; not the
    kinds the slice records lay out by rank). A step some rank of the world lacks is left out (its
    logical sum would be partial): the comparison then says incomplete."""
    world = run.manifest["scope"]["world_size"]
    steps: dict[int, list] = {}
    for rank in sorted(run.ranks):
        for rec in run.ranks[rank]:
            steps.setdefault(rec.step, []).append((rank, rec))
    records: dict[int, list] = {r: [] for r in range(width)}
    for step in sorted(steps):
        held = dict(steps[step])
        if len(held) != world:
            continue
        sliced = {s.get("kind") for rec in held.values() for s in rec.slices if isinstance(s, dict)}
        metrics, partials, small = {}, {}, {}
        for rank, rec in held.items():
            for name, value in rec.metrics.items():
                metrics.setdefault(name, value)
            for name, value in rec.digests.items():
                if name.startswith("logical_"):
                    partials.setdefault(name, []).append(value)
                elif rank == 0 and name not in LAYOUT_DIGESTS and name not in sliced:
                    small[name] = value
        digests = {**small, **{k: combine_partials(v) for k, v in partials.items()}}
        for r in range(width):
            rec = held.get(r, held[0])
            records[r].append(StepRecord(step=step, metrics={**metrics, **rec.metrics} if r in held else metrics,
                                         digests=digests if r == 0 else {}, line=rec.line, version=rec.version))
    files = {r: run.files.get(r, run.files[min(run.files)]) for r in range(width)} if run.files else {}
    return RunData(run.path, run.format, records, files, {**run.manifest, "scope": {
        **run.manifest["scope"], "world_size": width}}, run.hidden, run.warnings, run.truncated)


def _check_scope(a: RunData, b: RunData, force: bool, warnings: list[str]) -> list[dict]:
    if a.format == "tensorboard":
        warnings.append("TensorBoard logs carry no manifest: the validation scope was not checked")
        return []
    if a.manifest is None or b.manifest is None:
        state = {True: "missing", False: "present"}
        mismatches = [{"key": "manifest.json", "a": state[a.manifest is None], "b": state[b.manifest is None]}]
    else:
        diff = scope_diff(a.manifest["scope"], b.manifest["scope"])
        same_v = virtual_dp(a) is not None and virtual_dp(a) == virtual_dp(b)
        mismatches = [{"key": k, "a": va, "b": vb} for k, va, vb in diff if not (same_v and k in DP_LAYOUT_KEYS)]
    if mismatches and not force:
        raise ScopeMismatchError(mismatches)
    if mismatches:
        warnings.append(f"validation scopes differ in {len(mismatches)} key(s); compared anyway (--force)")
    return mismatches


def _select_ranks(a: RunData, b: RunData, wanted) -> list[int]:
    """The ranks asked for, else every rank of the manifests' world: a rank missing from both runs
    was compared in neither, so it is refused rather than left out of the verdict."""
    ranks = sorted(set(wanted)) if wanted is not None else sorted(set(a.ranks) | set(b.ranks))
    for rank in ranks:
        for run, other in ((a, b), (b, a)):
            if rank not in run.ranks:
                have = "" if rank not in other.ranks else f" (present: {other.files[rank]})"
                raise BitdetInputError(
                    f"{run.path}: fingerprint file for rank {rank} is missing "
                    f"(fingerprints/rank_{rank:05d}.jsonl){have}"
                )
    if wanted is None:
        for run in (a, b):
            if run.manifest is not None:  # a TensorBoard log dir has none
                require_every_rank(run, "; pass --ranks to compare only some ranks")
    return ranks


def _select_names(a: RunData, b: RunData, ranks: list[int], wanted) -> list[str]:
    present = {n for run in (a, b) for r in ranks for rec in run.ranks[r] for n in rec.values()}
    if wanted is None:
        return sorted(present - a.hidden - b.hidden, key=lambda n: (n.startswith(DIGEST_PREFIX), n))
    unknown = [n for n in wanted if n not in present]
    if unknown:
        raise BitdetInputError(f"no metric named {', '.join(map(repr, unknown))} in either run; "
                               f"available: {', '.join(sorted(present))}")
    return list(dict.fromkeys(wanted))


def _compare_steps(a: RunData, b: RunData, names: list[str], result: CompareResult, wanted: set | None) -> None:
    steps: dict[int, StepSummary] = {}
    only_a, only_b, missing = set(), set(), set()
    first: dict[int, list[MetricDiff]] = {}
    with_slices = any(n.startswith(DIGEST_PREFIX) for n in names)
    for rank in result.ranks_compared:
        recs_a, recs_b = (_records_with(run.ranks[rank], names) for run in (a, b))
        if wanted is not None:
            missing |= wanted - (recs_a.keys() | recs_b.keys())
            recs_a, recs_b = ({s: r for s, r in recs.items() if s in wanted} for recs in (recs_a, recs_b))
        elif a.format == "bitdet":  # a line per step: a gap (or a step holding no compared value) in both runs
            held = [r.step for run in (a, b) for r in run.ranks[rank]]
            missing |= set(range(min(held), max(held) + 1)) - (recs_a.keys() | recs_b.keys())
        only_a |= recs_a.keys() - recs_b.keys()
        only_b |= recs_b.keys() - recs_a.keys()
        for step in sorted(recs_a.keys() & recs_b.keys()):
            summary = steps.setdefault(step, StepSummary(step, {}, []))
            va, vb = recs_a[step].values(), recs_b[step].values()
            _same_digest_algorithms(names, va, vb, f"{a.files.get(rank)}:{recs_a[step].line}",
                                    f"{b.files.get(rank)}:{recs_b[step].line}")
            for name in names:
                diff = _diff(rank, name, va.get(name), vb.get(name))
                _accumulate(summary, name, diff)
                if diff is not None:
                    first.setdefault(step, []).append(diff)
            sa, sb = recs_a[step].slices, recs_b[step].slices
            if recs_a[step].version != recs_b[step].version:  # v2 checked other chunks than v3: own slices only
                sa, sb = ([x for x in s if "check_of" not in x] for s in (sa, sb))
            if with_slices and sa != sb:
                # v2 / v3's slice records (the replica checks' chunks among them: ``digests`` folds only a
                # rank's own) are compared whole, so every byte both lines record is covered
                diff = MetricDiff(rank=rank, name=DIGEST_PREFIX + "slices", a=None, b=None,
                                  note="slice records differ (the replica-check chunks, or a slice's bytes)")
                _accumulate(summary, diff.name, diff)
                first.setdefault(step, []).append(diff)
    result.per_step = [steps[s] for s in sorted(steps)]
    result.steps_compared = len(steps)
    result.diverged_steps = sorted(first)
    if not steps:
        ranks = result.ranks_compared
        raise BitdetInputError(f"no step in common: {a.path} has steps {_run_steps(a, ranks)}, "
                               f"{b.path} has {_run_steps(b, ranks)}"
                               + (f" (asked for {_span(sorted(wanted))})" if wanted is not None else "")
                               + "; nothing was compared")
    result.steps_only_in_a, result.steps_only_in_b = sorted(only_a), sorted(only_b)
    result.steps_in_neither = sorted(missing)
    if not first and result.lengths_differ:
        result.verdict = "incomplete"
    if first:
        step = result.diverged_steps[0]
        details = first[step]
        result.verdict = "diverged"
        result.first_divergence = Divergence(
            step=step, metrics=list(dict.fromkeys(d.name for d in details)),
            ranks=sorted({d.rank for d in details}), details=details,
        )


def _same_digest_algorithms(names, va: dict, vb: dict, where_a: str, where_b: str) -> None:
    """Digests made by two algorithms (fingerprint formats v1 and v2, a GPU's pos64r and a CPU's
    xxh3_64) differ whatever the state: refused, not reported as a divergence."""
    for name in names:
        if name.startswith(DIGEST_PREFIX) and name in va and name in vb:
            algo_a, algo_b = va[name].partition(":")[0], vb[name].partition(":")[0]
            if algo_a != algo_b:
                raise BitdetInputError(
                    f"{where_a} and {where_b}: {name} is {algo_a} in A but {algo_b} in B: digests of two "
                    "algorithms (fingerprint formats, or device and host paths) cannot be compared; compare "
                    "the metrics alone with --metrics")


def _records_with(records, names: list[str]) -> dict:
    """Steps that carry at least one compared name (TensorBoard tags are logged at their own steps)."""
    wanted = set(names)
    return {r.step: r for r in records if wanted & r.values().keys()}


def _accumulate(summary: StepSummary, name: str, diff: MetricDiff | None) -> None:
    if diff is not None and name not in summary.differing:
        summary.differing.append(name)
    if name.startswith(DIGEST_PREFIX):
        return
    ulp = 0 if diff is None else diff.ulp
    if name in summary.max_ulp and summary.max_ulp[name] is None:
        return  # already not comparable at another rank
    summary.max_ulp[name] = None if ulp is None else max(ulp, summary.max_ulp.get(name) or 0)


def _diff(rank: int, name: str, a: str | None, b: str | None) -> MetricDiff | None:
    """None when bit-identical (or absent on both sides), else what differs and by how much."""
    if a == b:
        return None
    d = MetricDiff(rank=rank, name=name, a=a, b=b)
    if a is None or b is None:
        d.note = f"present only in {'A' if b is None else 'B'}"
    elif name.startswith(DIGEST_PREFIX):
        d.note = "digest differs"
    else:
        d.a_value, d.b_value = decode_float(a), decode_float(b)
        d.ulp = ulp_distance(a, b)
        if d.ulp is None:
            d.note = f"dtype differs: {a.partition(':')[0]} vs {b.partition(':')[0]}"
        else:
            d.first_bit = first_differing_bit(a, b)
    return d


def _run_steps(run: RunData, ranks: list[int]) -> str:
    return _span(sorted({r.step for rank in ranks for r in run.ranks[rank]}))


def _span(steps: list[int]) -> str:
    return "none" if not steps else f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def step_ranges(steps: list[int]) -> str:
    """[1,2,3,7] -> '1-3, 7'."""
    out, start = [], None
    for i, s in enumerate(steps):
        start = s if start is None else start
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(str(s) if s == start else f"{start}-{s}")
            start = None
    return ", ".join(out)
