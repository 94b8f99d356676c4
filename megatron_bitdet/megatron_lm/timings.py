"""Per-step wall times of Megatron-LM's ``train_step`` on each rank, for the determinism tax of a
launch line (``bitdet prove --megatron-lm``). Kept apart from the fingerprints, which must be
byte-identical across runs (times never are). One JSON line per step per rank under
``RUN_DIR/timings/rank_XXXXX.jsonl`` (path: ``rundir``)::

    {"v": 1, "step": 3, "rank": 0, "seconds": 0.01234}

bitdet's own work inside the step (launching the device-resident digests: no host copy, no sync) is
part of the step's time, as it is of the run's cost; both boundaries synchronize the device first, so
queued GPU work (the backward) is counted in the step that launched it.
"""
from __future__ import annotations

import json
import math
import time

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import timings_path

FORMAT_VERSION = 1


def _sync() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepClock:
    """Times one ``train_step`` at a time (``start`` / ``stop``), synchronized at both ends."""

    def __init__(self, run_dir, rank: int):
        self.path = timings_path(run_dir, rank)
        self.rank = rank
        self._f = None
        self._t0 = None

    def start(self) -> None:
        _sync()
        self._t0 = time.perf_counter()

    def stop(self, step: int) -> None:
        """Append the step's line (flushed: a killed rank keeps every finished step)."""
        _sync()
        seconds = time.perf_counter() - self._t0
        if self._f is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a", encoding="utf-8")
        self._f.write(json.dumps({"v": FORMAT_VERSION, "step": step, "rank": self.rank, "seconds": seconds}) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_step_times(run_dir, nproc: int) -> dict[int, dict[int, float]]:
    """rank -> step -> seconds for ranks 0..nproc-1; every missing file, malformed or truncated line,
    foreign rank or repeated step is refused naming file:line."""
    out = {}
    for rank in range(nproc):
        path = timings_path(run_dir, rank)
        if not path.is_file():
            raise BitdetInputError(f"{path}: no step timings for rank {rank} "
                                   "(a Megatron-LM run under bitdet writes them)")
        data = path.read_bytes()
        lines = data.split(b"\n")
        if lines.pop():
            raise BitdetInputError(f"{path}:{len(lines) + 1}: truncated line (the run did not finish)")
        steps = {}
        for n, raw in enumerate(lines, 1):
            try:
                line = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError and over-long integers included
                raise BitdetInputError(f"{path}:{n}: not a JSON line") from None
            ok = (isinstance(line, dict) and line.get("v") == FORMAT_VERSION and line.get("rank") == rank
                  and type(line.get("step")) is int and line["step"] >= 1 and type(line.get("seconds")) is float
                  and math.isfinite(line["seconds"]) and line["seconds"] >= 0)
            if not ok:
                raise BitdetInputError(f"{path}:{n}: not a step timing of rank {rank} "
                                       f'(expected {{"v": {FORMAT_VERSION}, "step": N, "rank": {rank}, "seconds": S}})')
            if line["step"] in steps:
                raise BitdetInputError(f"{path}:{n}: step {line['step']} timed twice (a stale run directory?)")
            steps[line["step"]] = line["seconds"]
        out[rank] = steps
    return out
