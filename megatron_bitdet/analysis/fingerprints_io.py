"""Read a run's per-step fingerprints into one in-memory shape, strictly.

A comparison is only as good as its input: every malformed, truncated or foreign line is
refused with its file and line (BitdetInputError, exit 2) instead of being skipped, so a
"match" can never come from silently dropped steps.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_bitdet.enforce.manifest import load_manifest
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.floatbits import decode_bits

FORMAT_VERSION = 1
RANK_FILE = re.compile(r"rank_(\d+)\.jsonl")
DIGEST_PREFIX = "digest:"  # digests share the name space of metrics as "digest:<name>"


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


@dataclass
class RunData:
    """A run as comparisons see it: per rank, the step records in increasing step order."""

    path: Path
    format: str  # "bitdet" | "tensorboard"
    ranks: dict[int, list[StepRecord]]
    files: dict[int, Path]
    manifest: dict | None = None
    hidden: frozenset[str] = frozenset()  # names compared only when asked for by name
    warnings: list[str] = field(default_factory=list)
    truncated: list[Path] = field(default_factory=list)  # files cut short, read up to the cut (--allow-truncated)

    def steps(self, rank: int) -> list[int]:
        return [r.step for r in self.ranks[rank]]


def detect_format(path: Path) -> str:
    """'bitdet' for a run directory, 'tensorboard' for a dir of event files."""
    if not path.exists():
        raise BitdetInputError(f"{path}: no such run directory")
    if not path.is_dir():
        raise BitdetInputError(f"{path}: not a directory (expected a run dir or a TensorBoard log dir)")
    if (path / "fingerprints").is_dir():
        return "bitdet"
    if any(path.glob("events.out.tfevents.*")):
        return "tensorboard"
    raise BitdetInputError(
        f"{path}: neither a bitdet run (no fingerprints/ directory) nor a TensorBoard log dir "
        "(no events.out.tfevents.* files)"
    )


def load_run(path, fmt: str = "auto", *, allow_truncated: bool = False) -> RunData:
    """Load a run directory or a TensorBoard log dir; fmt is 'auto', 'bitdet' or 'tensorboard'."""
    path = Path(path)
    kind = detect_format(path) if fmt == "auto" else fmt
    if kind == "tensorboard":
        from megatron_bitdet.analysis.tensorboard_io import load_tensorboard

        if not path.is_dir():
            raise BitdetInputError(f"{path}: no such TensorBoard log directory")
        return load_tensorboard(path, allow_truncated=allow_truncated)
    if kind != "bitdet":
        raise BitdetInputError(f"unknown run format {fmt!r} (expected auto, bitdet or tensorboard)")
    return _load_bitdet(path, allow_truncated)


def _load_bitdet(path: Path, allow_truncated: bool) -> RunData:
    fp_dir = path / "fingerprints"
    if not fp_dir.is_dir():
        raise BitdetInputError(f"{path}: no fingerprints/ directory (not a bitdet run dir?)")
    files = {}
    for f in sorted(fp_dir.iterdir()):
        m = RANK_FILE.fullmatch(f.name)
        if m:
            files[int(m.group(1))] = f
    if not files:
        raise BitdetInputError(f"{fp_dir}: no rank_XXXXX.jsonl fingerprint files")
    run = RunData(path=path, format="bitdet", ranks={}, files=files)
    for rank, f in files.items():
        warned = len(run.warnings)
        run.ranks[rank] = read_rank_file(f, rank, allow_truncated=allow_truncated, warnings=run.warnings)
        if len(run.warnings) > warned:
            run.truncated.append(f)
    run.manifest = read_manifest(path / "manifest.json")
    return run


def read_rank_file(path: Path, rank: int, *, allow_truncated: bool = False, warnings=None) -> list[StepRecord]:
    """Parse one rank's JSON-lines file; every defect names path:line."""
    data = path.read_bytes()
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
        except (json.JSONDecodeError, UnicodeDecodeError):
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


def read_manifest(path: Path) -> dict | None:
    """The run manifest, or None when the run has none; a corrupt one is unusable input."""
    return load_manifest(path) if path.exists() else None
