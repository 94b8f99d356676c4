"""Rank modules by how far one step departs from the steps before it (per-module statistics of a replay).

A statistic departs when it rises above the largest value the previous steps had: its score is
``ln(value / previous max)`` (0 inside the range), infinite for non-finite values that were not there
before. A forward departure causes backward ones (the gradient of every module upstream of it grows
too), so modules are ranked by their outputs' departure first, then, among modules whose outputs stay in
range, by their gradients' (max |grad|, RMS, share of the gradient norm). Ties go to the module that
finished its forward first: a child before the container carrying its output, a producer before
its consumers. Rows are per rank, then merged: one row per module, from the rank where it departs most.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import stats_path
from megatron_bitdet.trace.module_stats import read_stats

FORWARD = ("out_max", "out_rms", "out_nonfinite", "load")
BACKWARD = ("grad_max", "grad_rms", "grad_share", "grad_nonfinite")


@dataclass
class Departure:
    module: str
    rank: int
    score: float             # the forward score, or the backward one when the outputs stay in range
    by: str                  # the statistic that departs most
    value: float
    previous: tuple[float, float]   # min, max over the previous steps
    stats: dict              # every statistic of the module at the step

    def to_json(self) -> dict:
        return asdict(self)


def load_stats(run_dir, world_size: int) -> dict[int, dict[int, dict]]:
    """{rank: {step: record}} for every rank of a run directory written with module statistics."""
    return {rank: read_stats(stats_path(run_dir, rank)) for rank in range(world_size)}


def _derived(record: dict) -> dict[str, dict]:
    """Per module: the recorded statistics plus grad_share, nonfinite and (experts) router load."""
    total = record["total_grad_sq"]
    routers = record["routers"]
    out = {}
    for name, row in record["modules"].items():
        row = dict(row)
        if "param_grad_sq" in row and total > 0:
            row["grad_share"] = row["param_grad_sq"] / total
        experts, sep, expert = name.rpartition(".expert_")
        router = experts.rpartition(".")[0] + ".router"
        if sep and expert.isdigit() and router in routers:
            load = routers[router]
            row["load"] = load[int(expert)] / sum(load) if sum(load) else 0.0
        out[name] = row
    return out


def _score(name: str, now: float, before: list[float]) -> float:
    if name.endswith("nonfinite"):
        return math.inf if now > max(before) else 0.0
    hi = max(before)
    if not (hi > 0) or not now > hi:
        return 0.0
    return math.log(now / hi) if math.isfinite(now) else math.inf


def rank_modules(records: dict[int, dict], step: int, previous: list[int], rank: int) -> list[Departure]:
    """One rank's modules at ``step`` against ``previous`` steps, most departing first."""
    missing = [s for s in (step, *previous) if s not in records]
    if missing:
        raise BitdetInputError(f"rank {rank}: no module statistics for step(s) {missing}")
    now = _derived(records[step])
    before = [_derived(records[s]) for s in previous]
    rows = []
    for name, stats in now.items():
        best = None
        for group in (FORWARD, BACKWARD):
            for stat in group:
                hist = [b[name][stat] for b in before if stat in b.get(name, {})]
                if stat not in stats or len(hist) != len(before):
                    continue
                score = _score(stat, stats[stat], hist)
                if best is None or score > best.score:
                    best = Departure(name, rank, score, stat, stats[stat], (min(hist), max(hist)), stats)
            if best is not None and best.score > 0:
                break  # the outputs depart: their score ranks the module
        if best is not None:
            rows.append(best)
    return sorted(rows, key=departure_key)


def departure_key(d: Departure):
    """Sort key: forward departures first, then by score, then forward completion order."""
    forward = d.by in FORWARD and d.score > 0
    return (not forward, -d.score, d.stats.get("order", math.inf), d.module, d.rank)


def merge(per_rank: dict[int, list[Departure]]) -> list[Departure]:
    """One row per module: the rank where it departs most (forward before backward; lowest rank on ties)."""
    best: dict[str, Departure] = {}
    for rank in sorted(per_rank):
        for d in per_rank[rank]:
            if d.module not in best or departure_key(d) < departure_key(best[d.module]):
                best[d.module] = d
    return sorted(best.values(), key=departure_key)


def router_load(stats: dict[int, dict[int, dict]], steps: list[int]) -> dict[str, dict[int, list[int]]]:
    """{router: {step: tokens per expert, summed over ranks}}."""
    out: dict[str, dict[int, list[int]]] = {}
    for records in stats.values():
        for step in steps:
            for name, load in records.get(step, {}).get("routers", {}).items():
                have = out.setdefault(name, {}).setdefault(step, [0] * len(load))
                out[name][step] = [a + b for a, b in zip(have, load)]
    return out
