"""benchmarks/gpu_check.py: byte-compiles and its CPU dry run prints the whole table (the real run
needs a GPU machine; CI proves the script is runnable, its swapped kernels bitwise on CPU, and its
training launches, 2 rounds each, reach the table)."""
import py_compile
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_compiles_and_dry_run_prints_the_table(tmp_path):
    py_compile.compile(str(SCRIPT), cfile=str(tmp_path / "gpu_check.pyc"), doraise=True)
    res = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("gpu_check on cpu (dry run)")
    swaps = [ln for ln in lines if " swap " in f" {ln} "]
    assert len(swaps) == 5 and all("bitwise (1 distinct)" in ln for ln in swaps), res.stdout
    assert any(ln.startswith("te_grouped_gemm") and "not importable" in ln for ln in lines)
    training = [ln for ln in lines if ln.startswith("default recipe (EP1)")]  # the same launches as on a GPU
    assert len(training) == 4, res.stdout
    for variant in ("tax", "module tracing", "op tracing", "untraced step"):
        assert sum(f"  {variant}  " in ln for ln in training) == 1, res.stdout
    assert all(ln.rstrip().endswith("x") for ln in training), res.stdout
