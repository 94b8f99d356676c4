"""End-to-end check: two independent short runs, compared with ``bitdet compare`` (every step, every
rank, every metric and digest, bit for bit). The runs are real ``bitdet train`` launches, as a user
would type them; any other launch line that writes a bitdet run directory works through ``command``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatron_bitdet.errors import BitdetError
from megatron_bitdet.testing.core import NondeterminismError, child_import_env

TAIL = 15


@dataclass(frozen=True)
class RunsReport:
    """Two runs that matched, and what the comparison covered."""

    run_a: Path
    run_b: Path
    steps: int
    ranks: int
    metrics: int
    digests: int

    def __str__(self) -> str:
        return (f"{self.run_a} and {self.run_b}: bit-identical ({self.steps} steps x {self.ranks} ranks x "
                f"{self.metrics} metrics + {self.digests} digests)")


def bitdet_command(*args: str) -> list:
    """``bitdet ARGS`` of this interpreter's installation (its console script, else ``python -m``),
    whatever else is on PATH."""
    script = Path(sys.executable).with_name("bitdet")
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "megatron_bitdet"]
    return [*head, *map(str, args)]


def train_command(recipe, overrides: Sequence[str] = (), *, nproc: int = 2, steps: int = 3,
                  model_provider: Optional[str] = None, train_args: Sequence[str] = ()) -> list:
    """The ``bitdet train`` line of one run, with ``{run_dir}`` where the run directory goes."""
    cmd = bitdet_command("train", "--recipe", recipe, "--deterministic-mode", "--nproc", nproc,
                         "--run-dir", "{run_dir}", *train_args)
    if model_provider:
        cmd += ["--model-provider", model_provider]
    return cmd + [f"training.iterations={steps}", *overrides]


def _tail(text: str) -> str:
    return "\n".join(f"    | {line}" for line in text.strip().splitlines()[-TAIL:])


def check_end_to_end(recipe="nemotron_h_tiny", overrides: Sequence[str] = (), *, workdir, nproc: int = 2,
                     steps: int = 3, model_provider: Optional[str] = None, train_args: Sequence[str] = (),
                     command: Optional[Sequence[str]] = None, expect_steps: Optional[int] = None,
                     timeout: float = 1800) -> RunsReport:
    """Run ``command`` (default: ``bitdet train --recipe RECIPE ... training.iterations=STEPS OVERRIDES``;
    ``{run_dir}`` is replaced) twice into ``workdir/a`` and ``workdir/b``, then ``bitdet compare``.
    Raises :class:`NondeterminismError` with compare's report when the runs diverge; BitdetError when a
    run fails, compare finds them incomplete or unusable, or they cover fewer than ``expect_steps``
    (default ``steps``) steps."""
    __tracebackhide__ = True  # pytest shows the message, not these frames
    template = list(command) if command is not None else train_command(
        recipe, overrides, nproc=nproc, steps=steps, model_provider=model_provider, train_args=train_args)
    if not any("{run_dir}" in str(part) for part in template):
        raise BitdetError("check_end_to_end: the command must contain '{run_dir}' (where each run writes)")
    workdir = Path(workdir)
    runs = [workdir / "a", workdir / "b"]
    env = {**os.environ, **child_import_env()}  # a model provider next to the tests imports in the ranks
    for run in runs:
        argv = [str(part).replace("{run_dir}", str(run)) for part in template]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            raise BitdetError(f"check_end_to_end: run {run.name} failed (exit {done.returncode}): {' '.join(argv)}\n"
                              f"{_tail(done.stderr or done.stdout)}\n  logs: {run / 'logs'}")
    done = subprocess.run(bitdet_command("compare", *runs, "--json"), capture_output=True, text=True, timeout=timeout)
    try:
        result = json.loads(done.stdout)
    except ValueError:
        raise BitdetError(f"check_end_to_end: bitdet compare failed (exit {done.returncode}):\n{_tail(done.stderr)}") from None
    if result["verdict"] == "diverged":
        report = subprocess.run(bitdet_command("compare", *runs), capture_output=True, text=True, timeout=timeout)
        raise NondeterminismError(
            f"check_end_to_end: two independent runs are not bit-identical (bitdet compare {runs[0]} {runs[1]}):\n"
            f"{report.stdout.rstrip()}\n  next: bitdet localize {runs[0]} {runs[1]}   "
            "(re-runs both with tracing around the first divergent step and names the op, module and rank)")
    if result["verdict"] != "match":
        raise BitdetError(f"check_end_to_end: bitdet compare says {result['verdict']} (exit {done.returncode}), not a "
                          f"match: {result.get('error') or ''}\n{_tail(done.stderr)}")
    want = steps if expect_steps is None else expect_steps
    ranks = nproc if command is None else 1
    if result["steps_compared"] < want or len(result["ranks_compared"]) < ranks:  # both runs stopped early
        raise BitdetError(f"check_end_to_end: the runs matched on {result['steps_compared']} steps of ranks "
                          f"{result['ranks_compared']}, fewer than the {want} steps on {ranks} ranks asked for "
                          f"({runs[0]}, {runs[1]})")
    return RunsReport(runs[0], runs[1], result["steps_compared"], len(result["ranks_compared"]),
                      len(result["metrics_compared"]), len(result["digests_compared"]))
