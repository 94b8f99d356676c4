"""Read Megatron-LM TensorBoard scalars as fingerprints, so plain Megatron runs can be compared.

Megatron logs with `writer.add_scalar`, stored as float32 `simple_value`: the float32 bit
pattern is exactly what was logged, so it is compared bit for bit like any fingerprint.
Tags that vary by nature (timers, throughput, memory) and the "vs samples" / "vs tokens"
duplicates (same values, another x axis) are left out unless asked for by name.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_bitdet.analysis.run_data import RunData
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.floatbits import encode_float
from megatron_bitdet.fingerprint.steps import StepRecord

TENSORBOARD_RANK = 0  # Megatron writes TensorBoard from one rank; it is shown as rank 0


@dataclass(frozen=True)
class TensorBoardConfig:
    """Which scalar tags count as metrics by default (glob patterns, matched case-insensitively)."""

    exclude: tuple[str, ...] = (
        "* vs samples", "* vs tokens", "*time*", "*throughput*", "mem-*", "*memory*",
    )


def load_tensorboard(path: Path, config: TensorBoardConfig = TensorBoardConfig()) -> RunData:
    """All scalars of one log dir, per step, each encoded as float32; by-nature-variable tags hidden."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise BitdetInputError(
            "reading TensorBoard logs needs the 'tensorboard' package: pip install tensorboard"
        ) from None
    acc = event_accumulator.EventAccumulator(str(path), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    tags = acc.Tags().get("scalars", [])
    if not tags:
        raise BitdetInputError(f"{path}: no scalars in the TensorBoard event files (or none found)")
    by_step: dict[int, dict[str, str]] = {}
    for tag in tags:
        for ev in acc.Scalars(tag):  # after a restart, the accumulator purges orphaned steps
            value = torch.tensor(ev.value, dtype=torch.float32)
            by_step.setdefault(int(ev.step), {})[tag] = encode_float(value)
    records = [StepRecord(step=s, metrics=m, digests={}, line=0) for s, m in sorted(by_step.items())]
    files = sorted(path.glob("events.out.tfevents.*"))
    return RunData(
        path=path, format="tensorboard", ranks={TENSORBOARD_RANK: records},
        files={TENSORBOARD_RANK: files[-1] if files else path},
        hidden=frozenset(t for t in tags if _excluded(t, config)),
    )


def _excluded(tag: str, config: TensorBoardConfig) -> bool:
    return any(fnmatch.fnmatch(tag.lower(), pat) for pat in config.exclude)
