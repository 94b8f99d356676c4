"""Run every benchmark in this folder, one after another (``make bench``); each prints its own ratios."""
import subprocess
import sys
from pathlib import Path

here = Path(__file__).parent
failed = []
for script in sorted(here.glob("bench_*.py")):
    print(f"\n=== {script.name}", flush=True)
    if subprocess.call([sys.executable, str(script)]) != 0:
        failed.append(script.name)
if failed:
    sys.exit(f"failed: {', '.join(failed)}")
