"""Paired medians with 95% bootstrap intervals, and goal verdicts that cover the whole interval: the
step benchmarks' shared statistics (bench_trace_training, bench_tax_vs_upstream). Single steps on the
shared 2-core machine spread by +-20%, so a paired median alone moves by several % between runs."""
from __future__ import annotations

import random
import statistics

MIN_ROUNDS = 10  # a goal's verdict needs a paired median of at least this many rounds


def paired_ratios(a: list, b: list) -> list[float]:
    """Each round's a / b (rounds aligned: the same round's steps of both sides)."""
    return [x / y for x, y in zip(a, b)]


def median_interval(values: list, resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median (values resampled with replacement, one seed)."""
    rng = random.Random(1)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def verdict(ratio: float, interval: tuple[float, float], goal: float, rounds: int) -> str:
    """"ok" only when the whole interval is within the goal (a ratio at most ``goal``), "MISSED" when
    none of it is; none at all below ``MIN_ROUNDS`` (a smoke run's two rounds would otherwise read "ok")."""
    if rounds < MIN_ROUNDS:
        return f"no verdict: {rounds} rounds, the goal needs >= {MIN_ROUNDS}"
    lo, hi = interval
    if hi <= goal:
        return "ok"
    if lo > goal:
        return "MISSED"
    return f"inconclusive: the interval spans {goal:.2f}x; median {'within' if ratio <= goal else 'above'}"
