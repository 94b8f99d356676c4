"""Offline `localize`: align two runs' per-rank traces by event id, find each rank's first mismatch,
classify it by role, and follow receivers to the rank whose producer started it.

Streaming: the two files of a rank are read in lockstep as raw lines; identical lines (the common
case) are never parsed. A bounded window of recent lines per run is kept so that, at the first
mismatch, the producer of a differing input can be looked up: memory is flat in trace length.
Ranks are compared in parallel processes.
"""
from __future__ import annotations

import os
import re
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.trace.format import event_id, open_trace, parse_record, trace_dir, trace_path

_TRIVIAL = frozenset({
    "view", "_unsafe_view", "reshape", "alias", "detach", "t", "transpose", "permute", "expand",
    "slice", "select", "as_strided", "unsqueeze", "squeeze", "contiguous", "clone", "copy_", "_to_copy",
    "add", "add_", "split", "split_with_sizes", "unbind", "cat", "flatten", "lift_fresh",
})
_RECEIVES = frozenset({"recv", "irecv", "batch.irecv", "broadcast", "all_reduce", "reduce_scatter",
                       "reduce_scatter_tensor", "_reduce_scatter_base", "all_gather", "all_gather_into_tensor",
                       "_all_gather_base", "all_to_all", "all_to_all_single"})
_RANK_FILE = re.compile(r"rank_(\d{5})\.trace\.jsonl$")

MATCH, PRODUCER, RECEIVER, EXTERNAL = "match", "producer", "receiver", "external_origin"
BLIND_SPOT, READ_ARTIFACT, CONTROL = "dispatcher_blind_spot", "read_artifact", "control_divergence"
FALSE_ALARMS = (BLIND_SPOT, READ_ARTIFACT)


@dataclass(frozen=True)
class LocalizeConfig:
    workers: int = 0          # 0: one per CPU
    history: int = 200_000    # recent lines kept per run to find where a differing input came from


@dataclass
class RankFinding:
    rank: int
    events: int                       # events compared (up to and including the first mismatch)
    classification: str = MATCH
    step: int | None = None
    phase: str | None = None
    event_id: str | None = None
    op: str | None = None
    module: str | None = None
    kind: str | None = None
    detail: str = ""
    peers: list[int] = field(default_factory=list)
    line: int | None = None
    inputs: dict = field(default_factory=dict)     # {"a": [...], "b": [...]}
    outputs: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    ignored: int = 0                  # differing records that carry no divergence (see _ignorable)
    incomplete: str = ""              # why the rank was not compared to the end (a truncated trace)


@dataclass
class LocalizeResult:
    per_rank: list[RankFinding]
    culprit: dict | None
    warnings: list[str]
    ranks_compared: int
    events_compared: int

    @property
    def mismatch(self) -> bool:
        return any(f.classification != MATCH for f in self.per_rank)

    @property
    def incomplete(self) -> list[str]:
        """Ranks whose traces were cut before their end: no mismatch there is not a match."""
        return [f"rank {f.rank}: {f.incomplete}" for f in self.per_rank if f.incomplete]

    @property
    def exit_code(self) -> int:
        """1 a mismatch; 2 no mismatch but a trace cut short (nothing after the cut was compared); 0 match."""
        return 1 if self.mismatch else 2 if self.incomplete else 0

    def to_json(self) -> dict:
        return {"mismatch": self.mismatch, "incomplete": self.incomplete, "ranks_compared": self.ranks_compared,
                "events_compared": self.events_compared,
                "per_rank": [asdict(f) for f in self.per_rank if f.classification != MATCH],
                "culprit": self.culprit, "warnings": self.warnings}


def _base_op(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) >= 3 and parts[0] == "aten" else name


def _find_producer(history: deque, fp: str) -> dict | None:
    """The most recent traced event (in the window) whose outputs include this fingerprint."""
    needle = fp.encode()
    for path, line_no, raw in reversed(history):
        if needle in raw:
            rec = parse_record(path, line_no, raw)
            if fp in rec.get("out", ()):
                return rec
    return None


def _place(f: RankFinding, rec: dict, line: int) -> None:
    """The finding's event: where ``rec`` (at ``line`` of its trace) ran."""
    f.step, f.phase, f.event_id, f.op, f.module, f.kind = (
        rec["step"], rec["phase"], event_id(rec), rec["name"], rec["scope"], rec.get("k"))
    f.line = line


def _fill(f: RankFinding, a: dict, b: dict, line: int) -> None:
    _place(f, b, line)
    f.inputs = {"a": a.get("in", []), "b": b.get("in", [])}
    f.outputs = {"a": a.get("out", []), "b": b.get("out", [])}


def _classify(f: RankFinding, a: dict, b: dict, hist_a: deque, hist_b: deque) -> None:
    flags = set(a.get("flags", ())) | set(b.get("flags", ()))
    name, peer = b["name"], b.get("peer") or {}
    if "reads_inflight" in flags:
        f.classification, f.detail = READ_ARTIFACT, "reads an async collective's output before its wait()"
        return
    if "reads_uninit" in flags:
        f.classification, f.detail = READ_ARTIFACT, "reads an uninitialized buffer (aten.empty* output never written)"
        return
    if a.get("in") == b.get("in"):
        if b.get("k") == "coll" and name in _RECEIVES and not (name == "broadcast" and peer.get("src") == f.rank):
            f.classification = RECEIVER
            f.peers = [peer["src"]] if "src" in peer else [r for r in peer.get("group", []) if r != f.rank]
            f.detail = f"inputs equal, output arrived through {name} from rank(s) {f.peers}"
        elif "uninit" in flags:
            f.classification, f.detail = READ_ARTIFACT, "output of an uninitialized allocation"
        else:
            f.classification, f.detail = PRODUCER, "inputs equal, outputs differ"
        return
    diff = [(x, y) for x, y in zip(a.get("in", []), b.get("in", [])) if x != y]
    if len(a.get("in", [])) != len(b.get("in", [])) or not diff:
        f.classification, f.detail = CONTROL, "different number of inputs"
        return
    fp_a, fp_b = diff[0]
    src = _find_producer(hist_a, fp_a) or _find_producer(hist_b, fp_b)
    src_flags = set(src.get("flags", ())) if src else set()
    if "uninit" in src_flags or "nonblocking" in src_flags:
        what = "an uninitialized buffer" if "uninit" in src_flags else "a non_blocking copy"
        f.classification, f.detail = READ_ARTIFACT, f"differing input is {what} ({event_id(src)})"
    elif _base_op(name) in _TRIVIAL:
        where = f"module {src['scope'] or '(top level)'}" if src else f"module {b['scope'] or '(top level)'}"
        f.classification = BLIND_SPOT
        f.detail = (f"trivial {_base_op(name)} got a differing input that no traced op produced: one hop later; "
                    f"inspect the custom (non-ATen) kernel that wrote it in {where}")
    else:
        f.classification = EXTERNAL
        f.detail = ("differing input was produced outside the trace (data path, restored state, "
                    "untraced kernel, or uninitialized buffer)"
                    + (f"; last traced producer: {event_id(src)}" if src else ""))


def _ignorable(a: dict, b: dict, taint_a: set, taint_b: set) -> bool:
    """A differing record pair that is not a divergence of the computation:

    - outputs bit-identical: the differing inputs never reached the result (an overwritten
      destination such as copy_ into fresh memory, a beta=0 operand of baddbmm);
    - it read uninitialized memory, or every differing input derives from such a read: garbage and
      its views differ run to run without meaning anything. Their outputs join the taint sets.
    """
    if a.get("out") == b.get("out"):
        return True
    ins_a, ins_b = a.get("in", []), b.get("in", [])
    flags = set(a.get("flags", ())) | set(b.get("flags", ()))
    diff = [(x, y) for x, y in zip(ins_a, ins_b) if x != y]
    garbage = "reads_uninit" in flags or (
        len(ins_a) == len(ins_b) and diff and all(x in taint_a or y in taint_b for x, y in diff))
    if garbage:
        taint_a.update(a.get("out", ()))
        taint_b.update(b.get("out", ()))
    return garbage


_CHUNK = 1 << 20


def _equal_prefix(path_a: Path, path_b: Path, max_chunks: int):
    """Skip the byte-identical prefix of two traces a chunk at a time (no per-line work).

    Returns the offsets (in A and B) of the first line that differs, the number of whole lines
    before it, and the last identical chunks (for looking up producers).
    """
    hist: deque = deque(maxlen=max_chunks)
    lines = done = 0
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        head_a, head_b = len(fa.readline()), len(fb.readline())
        carry = 0  # bytes of the current (unfinished) line in earlier chunks
        while True:
            ca, cb = fa.read(_CHUNK), fb.read(_CHUNK)
            if ca == cb:
                if not ca:
                    break
                hist.append(ca)
                lines += ca.count(b"\n")
                k = ca.rfind(b"\n")
                carry = len(ca) - k - 1 if k >= 0 else carry + len(ca)
                done += len(ca)
                continue
            i = next((j for j in range(0, min(len(ca), len(cb)), 4096) if ca[j:j + 4096] != cb[j:j + 4096]),
                     min(len(ca), len(cb)))
            i = next((j for j in range(i, min(len(ca), len(cb), i + 4096)) if ca[j] != cb[j]), min(len(ca), len(cb)))
            k = ca.rfind(b"\n", 0, i)
            if k >= 0:
                hist.append(ca[:k + 1])
                lines += ca.count(b"\n", 0, k + 1)
                done, carry = done + k + 1, 0
            break
    start = done - carry
    return head_a + start, head_b + start, lines, hist


def _history(path: Path, chunks: deque, last_line: int) -> deque:
    """(path, line number, raw line) for the whole lines held in the identical chunks."""
    raw = b"".join(chunks)
    lines = raw.split(b"\n")[:-1]
    first = last_line - len(lines) + 1
    if lines and not raw.startswith(b'{"step":'):
        lines, first = lines[1:], first + 1  # the oldest chunk starts mid-line
    return deque((path, first + n, line + b"\n") for n, line in enumerate(lines))


def compare_rank(job: tuple) -> RankFinding:
    """First mismatch of one rank, in that rank's own execution order."""
    rank, path_a, path_b, history = job
    ta, tb = open_trace(path_a), open_trace(path_b)
    f = RankFinding(rank=rank, events=0)
    off_a, off_b, skipped, chunks = _equal_prefix(ta.path, tb.path, max(2, history * 256 // _CHUNK))
    f.events = skipped
    hist_a: deque = deque(maxlen=history)  # lines compared one by one after the identical prefix
    hist_b: deque = deque(maxlen=history)
    taint_a: set = set()
    taint_b: set = set()
    it_a, it_b = ta.lines(off_a, skipped + 1), tb.lines(off_b, skipped + 1)
    while True:  # not zip(): it would take (and drop) A's next line before finding B at its end
        rest_a, rest_b = next(it_a, None), next(it_b, None)
        if rest_a is None or rest_b is None:
            break
        (la, ra), (lb, rb) = rest_a, rest_b
        f.events += 1
        if ra == rb:
            hist_a.append((ta.path, la, ra))
            hist_b.append((tb.path, lb, rb))
            continue
        a, b = parse_record(ta.path, la, ra), parse_record(tb.path, lb, rb)
        same_id = event_id(a) == event_id(b)
        if same_id and a.get("in") == b.get("in") and a.get("out") == b.get("out"):
            hist_a.append((ta.path, la, ra))  # extras differ (e.g. a wildcard recv's src): not numerical
            hist_b.append((tb.path, lb, rb))
            continue
        if same_id and _ignorable(a, b, taint_a, taint_b):
            f.ignored += 1
            hist_a.append((ta.path, la, ra))
            hist_b.append((tb.path, lb, rb))
            continue
        _fill(f, a, b, lb)
        if not same_id:
            f.classification = CONTROL
            f.detail = f"event sequences diverge: run A has {event_id(a)}, run B has {event_id(b)}"
        else:
            prefix = _history(ta.path, chunks, skipped + 1)  # built only now: the prefix is identical
            _classify(f, a, b, deque([*prefix, *hist_a], maxlen=history),
                      deque([*((tb.path, n, r) for _, n, r in prefix), *hist_b], maxlen=history))
        return f
    for t in (ta, tb):
        if getattr(t, "truncated", False):
            f.warnings.append(f"{t.path}: truncated final record ignored")
            f.incomplete = (f"{t.path} ends in a truncated record (a crashed or cut run): events after "
                            f"event {f.events} were not compared")
    if (rest_a or rest_b) and not f.warnings:
        longer, (line, raw) = (ta, rest_a) if rest_a else (tb, rest_b)
        _place(f, parse_record(longer.path, line, raw), line)  # the culprit: the ladder narrows to its step
        f.classification = CONTROL
        f.detail = f"{longer.path} has more events after event {f.events}, the first {f.event_id}"
    elif not f.events and not f.incomplete:
        f.incomplete = "neither trace holds an event (no traced step ran): nothing was compared"
    return f


def _rank_files(run_dir) -> dict[int, Path]:
    d = trace_dir(run_dir)
    if not d.is_dir():
        raise BitdetInputError(f"{run_dir}: no traces/ directory (rerun with tracing on)")
    return {int(m.group(1)): p for p in d.iterdir() if (m := _RANK_FILE.search(p.name))}


def _check_headers(run_a, run_b, ranks: list[int]) -> list[str]:
    """Headers must name their own rank, agree between runs, and account for every expected rank file."""
    warnings = []
    for run in (run_a, run_b):
        head = open_trace(trace_path(run, ranks[0])).header
        expected = head["ranks"] if head.get("ranks") is not None else range(head["world_size"])
        for r in expected:
            if not trace_path(run, r).is_file():
                raise BitdetInputError(f"{trace_path(run, r)}: trace file missing (world size {head['world_size']})")
    for r in ranks:
        ha, hb = open_trace(trace_path(run_a, r)).header, open_trace(trace_path(run_b, r)).header
        for h, run in ((ha, run_a), (hb, run_b)):
            if h["rank"] != r:
                raise BitdetInputError(f"{trace_path(run, r)}:1: header says rank {h['rank']}")
        for key in ("world_size", "level", "hash", "steps", "op_tracer"):
            if ha.get(key) != hb.get(key):
                raise BitdetInputError(f"{trace_path(run_b, r)}:1: {key} {hb.get(key)!r} differs from "
                                       f"{trace_path(run_a, r)} ({ha.get(key)!r}): traces not comparable")
        if ha.get("manifest_digest") != hb.get("manifest_digest") and r == ranks[0]:
            warnings.append("run manifests differ (manifest_digest): compare validation scopes first")
    return warnings


def _settle_culprit(findings: dict[int, RankFinding]) -> dict | None:
    """Follow receivers to the ranks that sent them differing data; the terminal non-receiver wins."""
    bad = {r: f for r, f in findings.items() if f.classification != MATCH}
    if not bad:
        return None
    votes: dict[int, int] = {}
    for r, f in bad.items():
        seen, cur = {r}, f
        while cur.classification == RECEIVER:
            nxt = [bad[p] for p in cur.peers if p in bad and p not in seen]
            if not nxt:
                break
            cur = min(nxt, key=lambda g: (g.classification == RECEIVER, g.step, g.rank))
            seen.add(cur.rank)
        votes[cur.rank] = votes.get(cur.rank, 0) + 1
    # a producer (inputs equal, outputs differ) beats a false alarm or an unexplained input on another rank:
    # per-rank orders say nothing about which came first, but only the producer is a cause
    rank = min(votes, key=lambda r: (bad[r].classification == RECEIVER, bad[r].classification != PRODUCER,
                                     -votes[r], bad[r].step, r))
    f = bad[rank]
    chain = sorted(r for r, g in bad.items() if g.classification == RECEIVER)
    if f.classification == RECEIVER:  # every member saw equal inputs at one collective: the collective itself
        return {"rank": rank, "classification": PRODUCER, "event_id": f.event_id, "op": f.op, "module": f.module,
                "step": f.step, "phase": f.phase,
                "evidence": "all participating ranks had equal inputs and differing outputs at this collective "
                            "(reduction order / transport nondeterminism)", "receivers": chain}
    return {"rank": rank, "classification": f.classification, "event_id": f.event_id, "op": f.op,
            "module": f.module, "step": f.step, "phase": f.phase, "false_alarm": f.classification in FALSE_ALARMS,
            "evidence": f.detail, "inputs": f.inputs, "outputs": f.outputs, "receivers": chain}


def localize_traces(run_a, run_b, config: LocalizeConfig = LocalizeConfig()) -> LocalizeResult:
    """Compare two runs' traces rank by rank (in parallel) and settle on a culprit."""
    fa, fb = _rank_files(run_a), _rank_files(run_b)
    for missing, present, run in ((set(fb) - set(fa), fb, run_a), (set(fa) - set(fb), fa, run_b)):
        if missing:
            raise BitdetInputError(f"{trace_path(run, min(missing))}: trace file missing "
                                   f"(present in {present[min(missing)].parent})")
    ranks = sorted(fa)
    if not ranks:
        raise BitdetInputError(f"{trace_dir(run_a)}: no rank_XXXXX.trace.jsonl files")
    warnings = _check_headers(run_a, run_b, ranks)
    jobs = [(r, fa[r], fb[r], config.history) for r in ranks]
    workers = min(config.workers or os.cpu_count() or 1, len(jobs))
    if workers <= 1:
        findings = [compare_rank(j) for j in jobs]
    else:
        with ProcessPoolExecutor(workers) as pool:
            findings = list(pool.map(compare_rank, jobs, chunksize=max(1, len(jobs) // (4 * workers))))
    for f in findings:
        warnings.extend(f.warnings)
    return LocalizeResult(findings, _settle_culprit({f.rank: f for f in findings}), warnings, len(findings),
                          sum(f.events for f in findings))
