"""One run's replicas checked against each other (``bitdet check RUN``), and its steps' digests combined
from the replicas' slices.

Fingerprint format v2 (``fingerprint.shards``) has every data-parallel replica digest its own slice of
a replicated DDP buffer and, at each step, one chunk of the next replica's slice. Replicas must hold
equal bytes, so the two digests of that chunk must be equal: a difference is silent data corruption
or a fault (a flipped bit in memory, a broken all-gather), found without a second run. Named by step,
buffer, byte range and the two ranks; the owner's chunk is the one that enters the step's digest.
The step's digest of each buffer is folded here, by the reader, from its members' chunks in group
order (the run never reduces it across ranks).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_bitdet.analysis.fingerprints_io import load_run
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.shards import combine


@dataclass
class Disagreement:
    step: int
    kind: str
    buf: str
    first_byte: int
    end_byte: int
    owner: int            # the rank whose slice holds the chunk (its digest enters the step's digest)
    owner_digest: str
    rank: int             # the replica that checked it and holds other bytes
    digest: str


@dataclass
class CheckResult:
    run: str
    steps: list[int] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    disagreements: list[Disagreement] = field(default_factory=list)
    step_digests: dict[int, dict[str, str]] = field(default_factory=dict)  # step -> "kind buf" -> digest
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.disagreements else 0

    @property
    def suspects(self) -> list[int]:
        """The ranks in every disagreement (one rank: the likely faulty replica; two: either)."""
        sets = [{d.owner, d.rank} for d in self.disagreements]
        return sorted(set.intersection(*sets)) if sets else []

    def to_json(self) -> dict:
        return {**asdict(self), "suspects": self.suspects}


def check_run(path, *, allow_truncated: bool = False) -> CheckResult:
    """Every replica check in the run's fingerprints matched with its owner's chunk; a v1 run (no
    slices) or a run with no replicas is refused as nothing to check (exit 2)."""
    run = load_run(path, "bitdet", allow_truncated=allow_truncated)
    result = CheckResult(run=str(run.path), warnings=list(run.warnings))
    owners: dict[tuple, tuple[int, dict]] = {}  # (step, kind, buf, group, index) -> (rank, {(lo, hi): hex})
    checks = []
    v1 = [f"{run.files[rank]}:{recs[0].line}" for rank, recs in run.ranks.items() if recs[0].version < 2]
    if v1:
        raise BitdetInputError(f"{v1[0]}: fingerprint format v1 (no per-replica slices): nothing to check")
    for rank, records in sorted(run.ranks.items()):
        for rec in records:
            for s in rec.slices:
                key = (rec.step, s["kind"], s["buf"], s["group"])
                where = f"{run.files[rank]}:{rec.line}"
                if "check_of" in s:
                    checks.append((key, s["check_of"], rank, s["parts"], where))
                else:
                    if (*key, s["index"]) in owners:
                        raise BitdetInputError(f"{where}: a second owner of slice {s['index']} of {s['kind']} "
                                               f"{s['buf']} (group {s['group']}) at step {rec.step}")
                    owners[(*key, s["index"])] = (rank, {(lo, hi): h for lo, hi, h in s["parts"]})
    result.steps = sorted({k[0] for k in owners})
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
            result.chunks_checked += 1
            result.bytes_checked += hi - lo
            if owned[(lo, hi)] != h:
                result.disagreements.append(Disagreement(key[0], key[1], key[2], lo, hi, owner_rank,
                                                         owned[(lo, hi)], rank, h))
    if not checks:
        raise BitdetInputError(f"{run.path}: no replica checks in its fingerprints (one data-parallel replica, "
                               "or every buffer megatron's owned shard): nothing to check")
    result.step_digests = _combined(owners)
    return result


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


def format_result(result: CheckResult, max_details: int = 20) -> str:
    span = f"steps {result.steps[0]}-{result.steps[-1]}" if result.steps else "no steps"
    what = f"{result.chunks_checked} chunks ({result.bytes_checked:,} bytes) checked replica against replica, {span}"
    if not result.disagreements:
        return f"CONSISTENT: {what}"
    lines = [f"REPLICAS DISAGREE: {len(result.disagreements)} of {what}"]
    for d in result.disagreements[:max_details]:
        lines.append(f"  step {d.step}: {d.kind} {d.buf} bytes {d.first_byte}-{d.end_byte}: rank {d.rank} holds "
                     f"{d.digest}, rank {d.owner} (the slice's owner) {d.owner_digest}")
    if len(result.disagreements) > max_details:
        lines.append(f"  ... {len(result.disagreements) - max_details} more (use --json for all)")
    suspects = result.suspects
    if len(suspects) == 1:
        lines.append(f"  rank {suspects[0]} is in every disagreement: its replica is the suspect")
    elif suspects:
        lines.append(f"  ranks {' and '.join(map(str, suspects))} are in every disagreement: either may be faulty "
                     "(two replicas cannot say which)")
    return "\n".join(lines)
