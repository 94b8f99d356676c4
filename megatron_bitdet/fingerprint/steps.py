"""The per-step fingerprint format, end to end: its version, the writer and the strict reader.

One JSON line per step per rank under ``RUN_DIR/fingerprints/rank_XXXXX.jsonl`` (path: ``rundir``)::

    {"v": 3, "step": 3, "rank": 0, "metrics": {"loss": "float32:3f8ccccd", ...},
     "digests": {"params": "pos64r:<hex>", "grads": "pos64r:<hex>", "buffers": "pos64r:<hex>"},
     "slices": [{"kind": "params", "buf": "0.dense.0", "group": "1f2e3d4c", "index": 0, "of": 2,
                 "sharded": false, "bytes": 717824, "parts": [[0, 90112, "<hex>"], ...]},
                {"kind": "params", "buf": "0.dense.0", "group": "1f2e3d4c", "index": 0, "of": 2,
                 "check_of": 1, "parts": [[409600, 458752, "<hex>"]]}, ...]}

v3 (``fingerprint.shards``): the digests are computed on the state's device (``pos64r``; CPU tensors
take the host fast path, ``xxh3_64``); a region replicated over ``of`` ranks is digested in slices,
``digests[kind]`` folding this rank's own chunks, ``slices`` saying which bytes each chunk covers and
which chunk of another replica's slice this rank checked: the step's check chunk, the same on every
replica (``Region.check_chunk``). v2 lines (each rank checked a chunk of the next rank's slice) are
still read: their own slices and digests are those of v3, their check records of other chunks.
v1 lines (``xxh3_128`` of every rank's whole buffers, no ``slices``) still read; their digests are
not comparable with v2's or v3's (``analysis.compare`` refuses to compare them).

A comparison is only as good as its input: every malformed, truncated or foreign line is refused
with its file and line (BitdetInputError, exit 2) instead of being skipped, so a "match" can never
come from silently dropped steps.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.floatbits import decode_bits, encode_float
from megatron_bitdet.rundir import fingerprint_path

FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
RANK_FILE = re.compile(r"rank_(\d+)\.jsonl")
DIGEST_PREFIX = "digest:"  # digests share the name space of metrics as "digest:<name>"


class StepFingerprintWriter:
    """Appends whole lines only, each flushed to the OS at once: a crashed or killed rank loses at most
    the step in flight. fsync (surviving a machine crash too) happens at close, not per step: it was
    two thirds of the fingerprint cost."""

    def __init__(self, run_dir, rank: int):
        path = fingerprint_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._f = open(path, "a", encoding="utf-8")

    def write(self, step: int, metrics: dict, digests: dict, slices: list) -> dict:
        """Append the step's line; returns it (as written) for whoever checks it on the fly (replay)."""
        line = {
            "v": FORMAT_VERSION,
            "step": step,
            "rank": self.rank,
            "metrics": {k: encode_float(v) for k, v in metrics.items() if v is not None},
            "digests": digests,
            "slices": slices,
        }
        self._f.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._f.flush()
        return line

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


@dataclass
class StepRecord:
    """One step of one rank: encoded metrics and digests, plus where it came from."""

    step: int
    metrics: dict[str, str]
    digests: dict[str, str]
    line: int
    version: int = FORMAT_VERSION
    slices: list = field(default_factory=list)

    def values(self) -> dict[str, str]:
        """Metrics and digests under one name space (digests prefixed)."""
        return {**self.metrics, **{DIGEST_PREFIX + k: v for k, v in self.digests.items()}}


def read_rank_file(path: Path, rank: int, *, allow_truncated: bool = False, warnings=None) -> list[StepRecord]:
    """Parse one rank's JSON-lines file; every defect names path:line."""
    try:
        data = path.read_bytes()
    except OSError as exc:  # a directory where the file should be, unreadable
        raise BitdetInputError(f"{path}: unreadable fingerprint file ({exc.strerror or exc})") from None
    if not data.strip():  # not a cut line: nothing was ever written
        raise BitdetInputError(f"{path}: empty fingerprint file (no steps)")
    lines = data.split(b"\n")
    ends_whole = data.endswith(b"\n")
    if ends_whole:
        lines.pop()  # the empty piece after the final newline
    records: list[StepRecord] = []
    for no, raw in enumerate(lines, start=1):
        where = f"{path}:{no}"
        is_last_partial = no == len(lines) and not ends_whole
        try:
            obj = json.loads(raw.decode("utf-8"))  # strict: json.loads(bytes) lets lone surrogates through
        except (ValueError, RecursionError):  # not JSON, not UTF-8, over-long integers, deep nesting
            if is_last_partial:
                if allow_truncated:
                    if warnings is not None:
                        warnings.append(f"{where}: truncated final line ignored (--allow-truncated)")
                    break
                raise BitdetInputError(
                    f"{where}: truncated final line (the writer stopped mid-line, e.g. a crash); "
                    "pass --allow-truncated to compare the steps before it"
                ) from None
            if no == 1:
                raise BitdetInputError(f"{where}: not a bitdet fingerprint file (first line is not JSON)") from None
            raise BitdetInputError(f"{where}: line is not valid JSON") from None
        records.append(_parse_record(obj, path, no, rank))
        if len(records) > 1 and records[-1].step <= records[-2].step:
            raise BitdetInputError(
                f"{where}: steps out of order (step {records[-1].step} after step {records[-2].step})"
            )
    if not records:
        raise BitdetInputError(f"{path}: empty fingerprint file (no steps)")
    return records


def _parse_record(obj, path: Path, no: int, rank: int) -> StepRecord:
    where, first = f"{path}:{no}", no == 1
    if not isinstance(obj, dict) or "v" not in obj or "metrics" not in obj:
        what = "not a bitdet fingerprint file" if first else "not a fingerprint line"
        raise BitdetInputError(f"{where}: {what} (expected a JSON object with 'v', 'step', 'metrics')")
    if obj["v"] not in READABLE_VERSIONS or isinstance(obj["v"], bool):
        raise BitdetInputError(f"{where}: unsupported fingerprint format version {obj['v']!r} "
                               f"(expected one of {', '.join(map(str, READABLE_VERSIONS))})")
    if "step" not in obj:
        raise BitdetInputError(f"{where}: line is missing 'step'")
    step = obj["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise BitdetInputError(f"{where}: 'step' must be an integer >= 1, got {step!r}")
    if obj.get("rank", rank) != rank:
        raise BitdetInputError(f"{where}: line says rank {obj['rank']!r} but the file is rank {rank}")
    metrics, digests = obj["metrics"], obj.get("digests", {})
    if not isinstance(metrics, dict) or not isinstance(digests, dict):
        raise BitdetInputError(f"{where}: 'metrics' and 'digests' must be JSON objects")
    for name, enc in metrics.items():
        try:
            decode_bits(enc if isinstance(enc, str) else "")
        except ValueError:
            raise BitdetInputError(f"{where}: metric {name!r} is not an encoded float: {enc!r}") from None
    for name, dig in digests.items():
        if not isinstance(dig, str) or ":" not in dig:
            raise BitdetInputError(f"{where}: digest {name!r} is not '<algo>:<hex>': {dig!r}")
    slices = obj.get("slices", [])
    if obj["v"] >= 2:
        _check_slices(slices, where)
    return StepRecord(step=step, metrics=metrics, digests=digests, line=no, version=obj["v"], slices=slices)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_slices(slices, where: str) -> None:
    """A v2 line's slice records, each refused by index with what is wrong."""
    if not isinstance(slices, list):
        raise BitdetInputError(f"{where}: 'slices' must be a JSON list")
    for i, rec in enumerate(slices):
        ok = (isinstance(rec, dict) and all(isinstance(rec.get(k), str) for k in ("kind", "buf", "group"))
              and _is_int(rec.get("index")) and _is_int(rec.get("of")) and rec["index"] < rec["of"]
              and isinstance(rec.get("parts"), list)
              and all(isinstance(p, list) and len(p) == 3 and _is_int(p[0]) and _is_int(p[1]) and p[0] < p[1]
                      and isinstance(p[2], str) for p in rec["parts"])
              and (_is_int(rec.get("check_of")) and rec["check_of"] < rec["of"] if "check_of" in rec
                   else _is_int(rec.get("bytes")) and isinstance(rec.get("sharded"), bool)))
        if not ok:
            raise BitdetInputError(f"{where}: slices[{i}] is not a slice record (kind, buf, group, index < of, "
                                   "parts [[first byte, end byte, hex], ...], and bytes + sharded or check_of)")
