"""benchmarks/bench_trace_training.py's verdicts: a goal reads "ok" only when the whole bootstrap
interval meets it, and a run of fewer rounds than the goal's paired median needs reads none."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.intervals import MIN_ROUNDS, verdict  # noqa: E402


def test_a_verdict_covers_the_whole_interval():
    assert verdict(1.05, (1.02, 1.09), 1.1, 100) == "ok"
    assert verdict(1.2, (1.15, 1.25), 1.1, 100) == "MISSED"
    assert verdict(1.09, (1.06, 1.16), 1.1, 100).startswith("inconclusive")


def test_too_few_rounds_get_no_verdict():
    assert MIN_ROUNDS == 10  # the "paired median of >= 10 rounds"
    assert verdict(1.01, (1.0, 1.02), 1.1, MIN_ROUNDS - 1).startswith("no verdict: 9 rounds")
    assert verdict(1.01, (1.0, 1.02), 1.1, MIN_ROUNDS) == "ok"


def test_one_round_is_refused_before_anything_runs():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_trace_training.py"), "--rounds", "1"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--rounds must be at least 2" in res.stderr, res.stderr[-2000:]
