"""benchmarks/bench_fingerprint_overhead.py measures what its rows name: at DP 2 the device path
(pos64r, forced on the CPU tensors), each rank digesting its half of the replicated buffers."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bitdet.fingerprint.shards import ROW_BYTES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_a_one_step_run_at_dp_2_measures_the_sharded_device_path():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fingerprint_overhead.py"),
                          "--steps", "1", "--warmup", "0", "--dp", "2",
                          "training.lr_schedule.warmup_iters=0"], capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    (row,) = [line for line in res.stdout.splitlines() if line.startswith("| device path")]
    assert "pos64r, forced on CPU" in row and "DP 2, EP 1, float32 params, distributed optimizer on" in row, row
    own = int(re.search(r"\| ([\d,]+) \+ [\d,]+ \|$", row).group(1).replace(",", ""))
    params = int(re.search(r"DP 2: .*?([\d,]+) params in DDP buffers", res.stdout).group(1).replace(",", ""))
    assert 0 < own <= 8 * params / 2 + 2 * ROW_BYTES, row  # fp32 params + grads: its half of them (sharded)
    assert "xxh3_64" not in res.stdout


def test_a_layout_the_recipe_cannot_run_exits_2_before_any_rank():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fingerprint_overhead.py"),
                          "--steps", "1", "--dp", "1,3"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "micro_batch_size x data-parallel size = 2 x 3" in res.stderr, res.stderr[-2000:]
    assert "DP 1:" not in res.stdout  # refused before the first launch
