"""One run's replicas checked against each other (``bitdet check RUN``), and its steps' digests combined
from the replicas' slices.

Fingerprint format v3 (``fingerprint.shards``) has every data-parallel replica digest its own slice of
a replicated region (a DDP buffer's params, reduced grads, main params; the optimizer's per-element
state without the distributed optimizer) and, at step ``s``, the region's check chunk ``s mod (D*K)``
(``Region.check_chunk``): at that step all ``D`` replicas digest the same bytes, its owner as part of
its slice. Replicas must hold equal bytes, so the ``D`` digests must be equal: a difference is silent
data corruption or a fault (a flipped bit in memory, a broken collective), found without a second
run. With 3 or more replicas the majority names the odd ones out; with 2 both are suspects. Within
``D*K`` consecutive steps every replica's copy of every chunk is compared.

No verdict without all the evidence: every rank of the manifest's world must have its file (exit 2
otherwise), and a rank whose file stops early, or a file read up to a cut (``--allow-truncated``),
makes the verdict INCOMPLETE (exit 1). What was covered, and what the layout leaves uncoverable
(owned shards), is part of the result. The step's digest of each region is folded here, by the
reader, from its members' chunks in group order (the run never reduces it across ranks).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from megatron_bitdet.analysis.fingerprints_io import load_run, require_every_rank
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.shards import CHECK_CHUNKS, combine


@dataclass
class Disagreement:
    step: int
    kind: str
    buf: str
    first_byte: int
    end_byte: int
    digests: dict[int, str]  # rank -> its digest of these bytes at this step
    suspects: list[int]      # the ranks outside a strict majority; every rank where there is none
    majority: bool


@dataclass
class Coverage:
    """One replicated region (kind, buffer, group) as the run's lines cover it."""

    kind: str
    buf: str
    replicas: int
    bytes: int
    steps: list[int]
    copies_compared: int     # distinct (replica, chunk) pairs compared with the other replicas at a step
    copies: int              # replicas x non-empty chunks: every replica's copy of every byte

    @property
    def complete(self) -> bool:
        return self.copies_compared == self.copies


@dataclass
class Uncoverable:
    """A region the layout gives one holder: nothing to compare it with."""

    kind: str
    buf: str
    why: str
    bytes: int | None = None  # None: from the manifest alone (the lines digest none of it)
    groups: int = 1           # an expert buffer's data-parallel groups repeat per EP rank

    def __str__(self) -> str:
        size = "" if self.bytes is None else f" ({self.bytes:,} bytes" + (
            f" in each of {self.groups} groups)" if self.groups > 1 else ")")
        return f"{self.kind} {self.buf}{size}: {self.why}: no replica to compare" + (
            " (manifest)" if self.bytes is None else "")


@dataclass
class CheckResult:
    run: str
    steps: list[int] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    disagreements: list[Disagreement] = field(default_factory=list)
    coverage: list[Coverage] = field(default_factory=list)
    uncoverable: list[Uncoverable] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    step_digests: dict[int, dict[str, str]] = field(default_factory=dict)  # step -> "kind buf group" -> digest
    warnings: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return "disagree" if self.disagreements else "incomplete" if self.incomplete else "consistent"

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "consistent" else 1

    @property
    def suspects(self) -> list[int]:
        """Every rank some disagreement names as a suspect."""
        return sorted({r for d in self.disagreements for r in d.suspects})

    def to_json(self) -> dict:
        out = asdict(self)
        out["coverage"] = [{**asdict(c), "complete": c.complete} for c in self.coverage]
        return {**out, "verdict": self.verdict, "suspects": self.suspects}


def stopped_early(run) -> list[str]:
    """Why the run's evidence is incomplete: a file read up to a cut, a rank with no line for a step
    another rank wrote."""
    out = [f"{f}: read up to a truncated final line (--allow-truncated): the steps after it are unchecked"
           for f in run.truncated]
    every = sorted({r.step for recs in run.ranks.values() for r in recs})
    for rank, recs in sorted(run.ranks.items()):
        lacking = sorted(set(every) - {r.step for r in recs})
        if lacking:
            out.append(f"{run.files[rank]}: rank {rank} has no line for step(s) {_span(lacking)} (its file stops "
                       "early or skips): those steps' chunks are unchecked")
    return out


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 and steps[-1] - steps[0] == len(steps) - 1 else \
        ", ".join(map(str, steps))


def check_run(path, *, allow_truncated: bool = False) -> CheckResult:
    """Every step's check chunks compared across the replicas that digested them; a v1 run (no
    slices), a run with no replicas or a rank missing from the manifest's world is refused (exit 2)."""
    run = load_run(path, "bitdet", allow_truncated=allow_truncated)
    result = CheckResult(run=str(run.path), warnings=list(run.warnings))
    v1 = [f"{run.files[rank]}:{recs[0].line}" for rank, recs in run.ranks.items() if recs[0].version < 2]
    if v1:
        raise BitdetInputError(f"{v1[0]}: fingerprint format v1 (no per-replica slices): nothing to check")
    require_every_rank(run)
    result.incomplete = stopped_early(run)
    owners: dict[tuple, tuple[int, dict]] = {}  # (step, kind, buf, group, index) -> (rank, {(lo, hi): hex})
    regions: dict[tuple, dict] = {}             # (kind, buf, group) -> {"of", "bytes", "sharded"}
    checks = []
    for rank, records in sorted(run.ranks.items()):
        for rec in records:
            for s in rec.slices:
                key = (rec.step, s["kind"], s["buf"], s["group"])
                where = f"{run.files[rank]}:{rec.line}"
                if "check_of" in s:
                    checks.append((key, s["check_of"], rank, s["parts"], where))
                    continue
                if (*key, s["index"]) in owners:
                    raise BitdetInputError(f"{where}: a second owner of slice {s['index']} of {s['kind']} "
                                           f"{s['buf']} (group {s['group']}) at step {rec.step}")
                owners[(*key, s["index"])] = (rank, {(lo, hi): h for lo, hi, h in s["parts"]})
                regions.setdefault(key[1:], {"of": s["of"], "bytes": s["bytes"], "sharded": s["sharded"]})
    result.steps = sorted({k[0] for k in owners})
    chunks: dict[tuple, dict[int, str]] = {}  # (step, kind, buf, group, lo, hi) -> {rank: hex}
    for key, owner_index, rank, parts, where in checks:
        held = owners.get((*key, owner_index))
        if held is None:
            result.warnings.append(f"{where}: checked slice {owner_index} of {key[1]} {key[2]} at step {key[0]}, "
                                   "but no line of the run holds it: unchecked")
            continue
        owner_rank, owned = held
        for lo, hi, h in parts:
            if (lo, hi) not in owned:
                raise BitdetInputError(f"{where}: checked bytes {lo}-{hi} of {key[1]} {key[2]} at step {key[0]}, "
                                       f"which are not a chunk of rank {owner_rank}'s slice")
            chunks.setdefault((*key, lo, hi), {owner_rank: owned[(lo, hi)]})[rank] = h
    if not checks:
        raise BitdetInputError(f"{run.path}: no replica checks in its fingerprints (one data-parallel replica, "
                               "or every buffer megatron's owned shard): nothing to check")
    compared: dict[tuple, set] = {}
    for (step, kind, buf, group, lo, hi), held in sorted(chunks.items()):
        if len(held) < 2:
            continue
        result.chunks_checked += 1
        result.bytes_checked += (hi - lo) * len(held)
        compared.setdefault((kind, buf, group), set()).update((r, lo, hi) for r in held)
        counts = Counter(held.values())
        if len(counts) > 1:
            top, n = counts.most_common(1)[0]
            majority = 2 * n > len(held)
            suspects = sorted(r for r, h in held.items() if h != top) if majority else sorted(held)
            result.disagreements.append(Disagreement(step, kind, buf, lo, hi, dict(sorted(held.items())),
                                                     suspects, majority))
    result.coverage, result.uncoverable = _coverage(owners, regions, compared, run.manifest)
    result.step_digests = _combined(owners)
    return result


def _coverage(owners: dict, regions: dict, compared: dict, manifest) -> tuple[list[Coverage], list[Uncoverable]]:
    """Per replicated region: the replica copies compared; the owned shards and the manifest's
    uncoverable kinds (``replica_check``, from ``train.step_fingerprints.replica_coverage``)."""
    chunk_sets: dict[tuple, set] = {}
    steps: dict[tuple, set] = {}
    for (step, kind, buf, group, _), (_, parts) in owners.items():
        chunk_sets.setdefault((kind, buf, group), set()).update(p for p in parts if p[1] > p[0])
        steps.setdefault((kind, buf, group), set()).add(step)
    covered, alone = [], {}
    for key, info in sorted(regions.items()):
        kind, buf, _ = key
        if info["of"] == 1 or info["sharded"]:  # an expert buffer's groups repeat per EP rank: said once
            why = "one replica" if info["of"] == 1 else "owned shards, one holder each"
            alone.setdefault((kind, buf, why), []).append(info["bytes"])
            continue
        covered.append(Coverage(kind, buf, info["of"], info["bytes"], sorted(steps[key]),
                                len(compared.get(key, ())), info["of"] * len(chunk_sets[key])))
    uncoverable = [Uncoverable(kind, buf, why, max(sizes), len(sizes)) for (kind, buf, why), sizes in alone.items()]
    seen = {f"{kind} {buf}" for kind, buf, _ in regions}
    for entry in (manifest or {}).get("replica_check") or []:
        if entry.get("layout") != "replicated" and f"{entry['kind']} {entry['buf']}" not in seen:
            seen.add(f"{entry['kind']} {entry['buf']}")
            uncoverable.append(Uncoverable(entry["kind"], entry["buf"], entry.get("why", entry.get("layout"))))
    if manifest is not None and "replica_check" not in manifest:
        uncoverable.append(Uncoverable("optimizer", "*", "not known: the manifest does not record the layout's "
                                       "coverage (replica_check), so owned shards no line digests are not listed"))
    return covered, uncoverable


def _combined(owners: dict) -> dict[int, dict[str, str]]:
    """Each step's digest of each buffer, folded from its members' chunks in group order."""
    groups: dict[tuple, list] = {}
    for (step, kind, buf, group, index), (_, parts) in owners.items():
        groups.setdefault((step, kind, buf, group), []).append((index, parts))
    out: dict[int, dict[str, str]] = {}
    for (step, kind, buf, group), members in sorted(groups.items()):
        chunks = [f"{index}:{lo}-{hi}:{h}" for index, parts in sorted(members) for (lo, hi), h in sorted(parts.items())]
        out.setdefault(step, {})[f"{kind} {buf} {group}"] = combine(chunks)
    return out


def coverage_summary(result: CheckResult) -> str:
    """One paragraph of what the check covered and what it could not (``bitdet prove``'s table)."""
    covered = "; ".join(f"{c.kind} {c.buf} {c.copies_compared} of {c.copies} replica-chunks"
                        + (" (all)" if c.complete else "") for c in result.coverage)
    out = (f"{result.chunks_checked} chunks compared across replicas, steps {_span(result.steps)}: {covered} "
           f"(every copy within replicas x {CHECK_CHUNKS} steps)")
    if result.uncoverable:
        out += "; not coverable in this layout (one holder): " + ", ".join(f"{u.kind} {u.buf}" for u in result.uncoverable)
    return out


def format_result(result: CheckResult, max_details: int = 20) -> str:
    span = f"steps {result.steps[0]}-{result.steps[-1]}" if result.steps else "no steps"
    what = f"{result.chunks_checked} chunks ({result.bytes_checked:,} replica bytes) compared across replicas, {span}"
    head = {"consistent": "CONSISTENT", "incomplete": "INCOMPLETE", "disagree": "REPLICAS DISAGREE"}[result.verdict]
    lines = [f"{head}: {len(result.disagreements)} disagreeing of {what}" if result.disagreements
             else f"{head}: {what}"]
    for d in result.disagreements[:max_details]:
        ranks = sorted(d.digests)
        if d.majority:
            rest = [r for r in ranks if r not in d.suspects]
            why = (f"rank(s) {', '.join(map(str, d.suspects))} differ from the majority "
                   f"({len(rest)} of {len(ranks)} replicas: ranks {', '.join(map(str, rest))} hold "
                   f"{d.digests[rest[0]]})")
        else:
            why = f"ranks {', '.join(map(str, ranks))} disagree with no majority: every one a suspect"
        held = ", ".join(f"rank {r} {h}" for r, h in d.digests.items())
        lines.append(f"  step {d.step}: {d.kind} {d.buf} bytes {d.first_byte}-{d.end_byte}: {why} [{held}]")
    if len(result.disagreements) > max_details:
        lines.append(f"  ... {len(result.disagreements) - max_details} more (use --json for all)")
    if result.disagreements:
        named = result.suspects
        lines.append(f"  suspect replica{'s: ranks' if len(named) > 1 else ': rank'} {', '.join(map(str, named))}")
    lines += [f"  incomplete: {why}" for why in result.incomplete]
    lines.append("covered (every replica's copy of a chunk compared with the others' at the same step; all within "
                 f"replicas x {CHECK_CHUNKS} steps):")
    for c in result.coverage:
        state = "every copy of every byte" if c.complete else \
            f"{c.copies_compared} of {c.copies} replica-chunks (a run of {c.replicas * CHECK_CHUNKS} steps covers all)"
        lines.append(f"  {c.kind} {c.buf}: {c.bytes:,} bytes x {c.replicas} replicas, steps {_span(c.steps)}: {state}")
    if result.uncoverable:
        lines.append("not coverable in this layout:")
        lines += [f"  {u}" for u in result.uncoverable]
    return "\n".join(lines)
