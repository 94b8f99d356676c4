"""benchmarks/gpu_check.py: byte-compiles, and its CPU dry run with one planted failing row still prints
the whole table (the real run needs a GPU machine; CI proves the script is runnable, its swapped kernels
bitwise on CPU, its training launches (tax, tracing, bitdet vs upstream), 2 rounds each, reach the
table, and one broken row costs only that row)."""
import py_compile
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
CHECKS = ("grouped-GEMM dprob", "MoE aux loss", "Mamba-2 SSD scan", "gated RMSNorm", "causal conv1d",
          "TE grouped GEMM", "grouped_mm fp32", "grouped_mm bf16", "FusedAdam resume", "device digest",
          "TE-spec model twins", "TE FP8 twins", "default recipe (EP1)", "bitdet vs upstream")


def test_gpu_check_dry_run_with_a_planted_failure_prints_the_whole_table(tmp_path):
    py_compile.compile(str(SCRIPT), cfile=str(tmp_path / "gpu_check.pyc"), doraise=True)
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--plant-failure", "MoE aux loss"],
                         capture_output=True, text=True, timeout=420)
    assert res.returncode == 1, res.stderr[-2000:]  # the planted row failed, nothing else did
    lines = res.stdout.splitlines()
    assert lines[0].startswith("gpu_check on cpu (dry run)")
    rows = lines[3:]
    assert [c for c in CHECKS if not any(ln.startswith(c) for ln in rows)] == [], res.stdout
    failed = [ln for ln in rows if "FAILED" in ln]
    assert len(failed) == 1 and failed[0].startswith("MoE aux loss") and "planted failure" in failed[0], res.stdout
    swaps = [ln for ln in rows if " swap " in f" {ln} "]
    assert len(swaps) == 6 and all("bitwise (1 distinct)" in ln for ln in swaps), res.stdout
    for check in ("TE grouped GEMM", "TE-spec model twins", "TE FP8 twins"):
        assert any(ln.startswith(check) and "not importable" in ln for ln in rows), res.stdout
    assert any(ln.startswith("FusedAdam resume") and "bitwise resume" in ln for ln in rows), res.stdout
    assert any(ln.startswith("device digest") and "GiB/s vs memcpy" in ln for ln in rows), res.stdout
    training = [ln for ln in rows if ln.startswith("default recipe (EP1)")]  # the same launches as on a GPU
    assert len(training) == 4, res.stdout
    for variant in ("tax", "module tracing", "op tracing", "untraced step"):
        assert sum(f"  {variant}  " in ln for ln in training) == 1, res.stdout
    assert all(ln.rstrip().endswith("x") for ln in training), res.stdout
    (vs_upstream,) = [ln for ln in rows if ln.startswith("bitdet vs upstream (default, EP1)")]
    assert "2 paired rounds" in vs_upstream and "no verdict: 2 rounds" in vs_upstream, res.stdout
    assert sum(ln.startswith("row: ") for ln in res.stderr.splitlines()) == len(rows)  # streamed as they came


def test_gpu_check_refuses_an_unknown_planted_check():
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--plant-failure", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "no such check" in res.stderr and "MoE aux loss" in res.stderr
    assert "Traceback" not in res.stderr
