"""Megatron-style console lines (tools parse them) and a progress bar when a person is watching."""
from __future__ import annotations

import os
import sys


def _fmt(x) -> str:
    return "n/a" if x is None else f"{float(x):.6E}"


class Console:
    """Speaks only on the rank that holds the loss (the last pipeline stage's last rank)."""

    def __init__(self, active: bool, total: int):
        self.active = active
        self.progress = None
        if active and os.environ.get("BITDET_INTERACTIVE") == "1":
            from rich.console import Console as RichConsole
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[loss]}"), TimeRemainingColumn(),
                console=RichConsole(file=sys.stdout, force_terminal=True),
            )
            self.task = self.progress.add_task("train", total=total, loss="")
            self.progress.start()

    def step(self, step, total, *, elapsed_ms, lr, lm_loss, aux, grad_norm, consumed, skipped):
        if not self.active:
            return
        line = (
            f" iteration {step:8d}/{total:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {elapsed_ms:.1f} | learning rate: {_fmt(lr)} | "
            f"lm loss: {_fmt(lm_loss)} | load_balancing_loss: {_fmt(aux)} | loss scale: 1.0 | "
            f"grad norm: {'n/a' if grad_norm is None else f'{float(grad_norm):.3f}'} | "
            f"number of skipped iterations: {skipped:3d} | number of nan iterations:   0 |"
        )
        if self.progress:
            self.progress.console.print(line, highlight=False)
            self.progress.update(self.task, completed=step, loss=f"lm loss {_fmt(lm_loss)}")
        else:
            print(line, flush=True)

    def note(self, text: str) -> None:
        if self.active:
            (self.progress.console.print if self.progress else print)(f"[bitdet] {text}")
            sys.stdout.flush()

    def close(self):
        if self.progress:
            self.progress.stop()
