"""The run directory: every path bitdet writes under RUN_DIR, and the fresh-directory rule.

    RUN_DIR/
      manifest.json                     written at start by rank 0
      fingerprints/rank_XXXXX.jsonl     one line per step per rank (format: fingerprint.steps)
      checkpoints/iter_NNNNNNN/         + checkpoints/latest (format: train.checkpoint)
      snapshots/iter_NNNNNNN/rank_XXXXX.pt
      traces/rank_XXXXX.trace.jsonl     with tracing on (format: trace.format)
      stats/rank_XXXXX.stats.jsonl      per-module statistics, a replay's (format: trace.module_stats)
      replay/<name>/                    `bitdet replay`'s runs, each a run directory + replay.json
      logs/rank_XXXXX.log               every rank's stdout + stderr

Fingerprints and traces are appended to, so a run that must stand alone starts from a fresh
directory (``fresh``); workflows that re-run into their own directories always do.
"""
from __future__ import annotations

import shutil
from pathlib import Path

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
    return Path(run_dir) / "snapshots" / f"iter_{step:07d}" / f"rank_{rank:05d}.pt"


def trace_dir(run_dir) -> Path:
    return Path(run_dir) / "traces"


def trace_path(run_dir, rank: int) -> Path:
    return trace_dir(run_dir) / f"rank_{rank:05d}.trace.jsonl"


def stats_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / "stats" / f"rank_{rank:05d}.stats.jsonl"


def replay_dir(run_dir, name: str) -> Path:
    """Where ``bitdet replay`` puts one replay of ``run_dir`` by default."""
    return Path(run_dir) / "replay" / name


def logs_dir(run_dir) -> Path:
    return Path(run_dir) / "logs"


def log_path(run_dir, rank: int) -> Path:
    return logs_dir(run_dir) / f"rank_{rank:05d}.log"


def fresh(run_dir) -> Path:
    """Remove whatever an earlier run left in ``run_dir`` and recreate it empty."""
    shutil.rmtree(run_dir, ignore_errors=True)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    return Path(run_dir)
