"""The run directory: every path bitdet writes under RUN_DIR, and the fresh-directory rule.

    RUN_DIR/
      manifest.json                     written at start by rank 0
      fingerprints/rank_XXXXX.jsonl     one line per step per rank (format: fingerprint.steps)
      checkpoints/iter_NNNNNNN/         + checkpoints/latest (format: train.checkpoint)
      snapshots/iter_NNNNNNN/rank_XXXXX.json  live-state digests (format: train.snapshot)
      snapshots/iter_NNNNNNN/rank_XXXXX.full.pt  full tensors, only where asked for (train.snapshot)
      traces/rank_XXXXX.trace.jsonl     with tracing on (format: trace.format)
      stats/rank_XXXXX.stats.jsonl      per-module statistics, a replay's (format: trace.module_stats)
      replay/<name>/                    `bitdet replay`'s runs, each a run directory + replay.json
      captures/rank_XXXXX.capture.pt    one op occurrence's inputs, the kernel rung (format: trace.capture)
      logs/rank_XXXXX.log               every rank's stdout + stderr
      timings/rank_XXXXX.jsonl          Megatron-LM runs: wall time of each step (format: megatron_lm.timings)

Fingerprints and traces are appended to, so a run that must stand alone starts from a fresh
directory (``fresh``); workflows that re-run into their own directories always do.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatron_bitdet.errors import BitdetInputError

MANIFEST = "manifest.json"
LATEST = "latest"


def manifest_path(run_dir) -> Path:
    return Path(run_dir) / MANIFEST


def fingerprints_dir(run_dir) -> Path:
    return Path(run_dir) / "fingerprints"


def fingerprint_path(run_dir, rank: int) -> Path:
    return fingerprints_dir(run_dir) / f"rank_{rank:05d}.jsonl"


def checkpoints_dir(run_dir) -> Path:
    """The default checkpoint root of a run."""
    return Path(run_dir) / "checkpoints"


def iter_dir(root, iteration: int) -> Path:
    """One iteration's checkpoint under any checkpoint root."""
    return Path(root) / f"iter_{iteration:07d}"


def snapshot_path(run_dir, step: int, rank: int) -> Path:
    """A rank's live-state digest file at ``step``."""
    return Path(run_dir) / "snapshots" / f"iter_{step:07d}" / f"rank_{rank:05d}.json"


def snapshot_full_path(run_dir, step: int, rank: int) -> Path:
    """The full tensors a snapshot was asked to keep (a second pass, or ``--full-snapshots``)."""
    return snapshot_path(run_dir, step, rank).with_suffix(".full.pt")


def trace_dir(run_dir) -> Path:
    return Path(run_dir) / "traces"


def trace_path(run_dir, rank: int) -> Path:
    return trace_dir(run_dir) / f"rank_{rank:05d}.trace.jsonl"


def stats_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / "stats" / f"rank_{rank:05d}.stats.jsonl"


def replay_dir(run_dir, name: str) -> Path:
    """Where ``bitdet replay`` puts one replay of ``run_dir`` by default."""
    return Path(run_dir) / "replay" / name
def capture_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / "captures" / f"rank_{rank:05d}.capture.pt"


def timings_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / "timings" / f"rank_{rank:05d}.jsonl"


def logs_dir(run_dir) -> Path:
    return Path(run_dir) / "logs"


def log_path(run_dir, rank: int) -> Path:
    return logs_dir(run_dir) / f"rank_{rank:05d}.log"


def make_dir(path, what: str = "run directory") -> Path:
    """``path`` and its parents created (exist_ok); BitdetInputError naming ``path`` and the file in the
    way, or the OS's reason, when it cannot be."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a directory" if blocker else (exc.strerror or str(exc))
        raise BitdetInputError(f"{path}: cannot create the {what}: {why}") from None
    return path


def fresh(run_dir) -> Path:
    """Remove whatever an earlier run left in ``run_dir`` and recreate it empty."""
    shutil.rmtree(run_dir, ignore_errors=True)
    return make_dir(run_dir)


def read_result(path, what: str, required=()) -> dict | None:
    """A JSON result bitdet saved (ladder, verify-resume): None when absent; BitdetInputError naming the
    file when it is not a JSON object with the ``required`` keys."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, RecursionError):  # not JSON, not UTF-8, over-long integers, deep nesting
        raise BitdetInputError(f"{path}: not a {what} (corrupt JSON)") from None
    missing = [k for k in required if not isinstance(data, dict) or k not in data]
    if not isinstance(data, dict) or missing:
        raise BitdetInputError(f"{path}: not a {what}" + (f" (no {missing[0]!r})" if missing else ""))
    return data


def load_tensors(path, what: str, *, map_location="cpu", mmap: bool = False):
    """A ``torch.save`` file bitdet wrote (snapshot, capture), read as untrusted input: ``weights_only``,
    and any byte sequence that is not one a BitdetInputError naming the file and ``what`` it should be.
    ``mmap``: map the tensors' bytes instead of reading them (a check that only needs the structure)."""
    import torch

    try:
        return torch.load(path, weights_only=True, map_location=map_location, mmap=mmap)
    except FileNotFoundError:
        raise BitdetInputError(f"{path}: {what} missing") from None
    except Exception as exc:  # any byte sequence: pickle, zip and torch errors alike
        first = (str(exc).strip().splitlines() or [""])[0]
        raise BitdetInputError(f"{path}: not a readable {what} ({type(exc).__name__}: {first[:200]})") from None
