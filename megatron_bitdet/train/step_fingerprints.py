"""Per-step fingerprints: one flushed JSON line per step per rank (format in docs/DESIGN.md)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_bitdet.fingerprint import encode_float
from megatron_bitdet.fingerprint.tensor import state_digest

FORMAT_VERSION = 1


def fingerprint_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / "fingerprints" / f"rank_{rank:05d}.jsonl"


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


def ddp_buffers(ddp_modules, attr: str) -> list:
    """megatron DDP's contiguous ``param_data`` or ``grad_data`` buffers on this rank, dense then expert."""
    return [getattr(b, attr) for m in ddp_modules for b in (*m.buffers, *m.expert_parallel_buffers)]


def buffer_digest(ddp_modules, attr: str) -> str:
    """Digest of the rank's DDP buffers: one hash over a few large tensors, negligible next to a step."""
    return state_digest((f"buf{i}", t) for i, t in enumerate(ddp_buffers(ddp_modules, attr)))
