"""The per-step fingerprint format, end to end: its version, the writer and the strict reader.

One JSON line per step per rank under ``RUN_DIR/fingerprints/rank_XXXXX.jsonl`` (path: ``rundir``)::

    {"v": 1, "step": 3, "rank": 0, "metrics": {"loss": "float32:3f8ccccd", ...},
     "digests": {"params": "xxh3_128:<hex>", "grads": "xxh3_128:<hex>"}}

A comparison is only as good as its input: every malformed, truncated or foreign line is refused
with its file and line (BitdetInputError, exit 2) instead of being skipped, so a "match" can never
come from silently dropped steps.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.floatbits import decode_bits, encode_float
from megatron_bitdet.rundir import fingerprint_path

FORMAT_VERSION = 1
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

    def write(self, step: int, metrics: dict, digests: dict) -> dict:
        """Append the step's line; returns it (as written) for whoever checks it on the fly (replay)."""
        line = {
            "v": FORMAT_VERSION,
            "step": step,
            "rank": self.rank,
            "metrics": {k: encode_float(v) for k, v in metrics.items() if v is not None},
            "digests": digests,
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

    def values(self) -> dict[str, str]:
        """Metrics and digests under one name space (digests prefixed)."""
        return {**self.metrics, **{DIGEST_PREFIX + k: v for k, v in self.digests.items()}}


def read_rank_file(path: Path, rank: int, *, allow_truncated: bool = False, warnings=None) -> list[StepRecord]:
    """Parse one rank's JSON-lines file; every defect names path:line."""
    try:
        data = path.read_bytes()
    except OSError as exc:  # a directory where the file should be, unreadable
        raise BitdetInputError(f"{path}: unreadable fingerprint file ({exc.strerror or exc})") from None
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
    if obj["v"] != FORMAT_VERSION:
        raise BitdetInputError(f"{where}: unsupported fingerprint format version {obj['v']!r} (expected 1)")
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
    return StepRecord(step=step, metrics=metrics, digests=digests, line=no)
