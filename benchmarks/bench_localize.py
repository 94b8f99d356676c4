"""Comparator throughput on synthetic traces of 256 ranks (written with the real TraceWriter).

Run: python benchmarks/bench_localize.py [ranks] [events_per_rank]   (about a minute on 2 CPU cores)
Every rank's trace is identical in both runs except rank 7, whose event 3/4 of the way through
differs (a planted producer), so nearly every event is compared. Goal: >= 1M events/s.
"""
from __future__ import annotations

import json
import resource
import sys
import tempfile
import time

from megatron_bitdet.analysis.localize import LocalizeConfig, localize_traces
from megatron_bitdet.trace.format import TraceWriter, trace_path


def write_run(run_dir: str, ranks: int, events: int, planted: bool) -> None:
    for r in range(ranks):
        w = TraceWriter(trace_path(run_dir, r), {"rank": r, "world_size": ranks, "level": "op",
                                                 "steps": [1, 1], "ranks": None, "hash": "fast",
                                                 "manifest_digest": None})
        lines = []
        for i in range(events):
            out = f"{(i * 2654435761 + r) & 0xFFFFFFFFFFFFFFFF:016x}"
            if planted and r == 7 and i == events * 3 // 4:
                out = "f" * 16
            lines.append(json.dumps({"step": 1, "phase": "forward", "scope": f"decoder.layers.{i % 52}.mlp",
                                     "name": "aten.mm.default", "n": i // 52, "k": "op",
                                     "in": [f"bfloat16[4096,2688]:{i:016x}"], "out": [f"bfloat16[4096,1856]:{out}"]},
                                    separators=(",", ":")))
        w.write_lines(lines)
        w.close()


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    events = int(sys.argv[2]) if len(sys.argv) > 2 else 8000
    tmp = tempfile.mkdtemp()
    write_run(f"{tmp}/a", ranks, events, planted=False)
    write_run(f"{tmp}/b", ranks, events, planted=True)
    for workers in (1, 0):
        t0 = time.perf_counter()
        res = localize_traces(f"{tmp}/a", f"{tmp}/b", LocalizeConfig(workers=workers))
        dt = time.perf_counter() - t0
        label = "1 process" if workers == 1 else "one per CPU"
        print(f"{ranks} ranks x {events} events x 2 runs, {label}: {res.events_compared / dt / 1e6:.2f}M events/s "
              f"({dt:.2f} s); culprit rank {res.culprit['rank']} {res.culprit['classification']}")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
          f"largest worker: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
