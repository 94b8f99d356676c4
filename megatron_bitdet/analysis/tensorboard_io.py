"""Read Megatron-LM TensorBoard scalars as fingerprints, so plain Megatron runs can be compared.

Megatron logs with `writer.add_scalar`, stored as float32 `simple_value`: the float32 bit
pattern is exactly what was logged, so it is compared bit for bit like any fingerprint.
Tags that vary by nature (timers, throughput, memory) and the "vs samples" / "vs tokens"
duplicates (same values, another x axis) are left out unless asked for by name.
"""
from __future__ import annotations

import fnmatch
import struct
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


def truncated_at(event_file: Path) -> int | None:
    """Byte offset of a record cut short (a writer killed mid-record), else None; BitdetInputError at a
    record whose length or data CRC fails. TFRecord framing: u64 length, u32 masked CRC32C of the length,
    data, u32 masked CRC32C of the data. TensorBoard's reader stops at either silently: every step
    after it would be missing without a word."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c  # the reader's own

    data = event_file.read_bytes()
    pos = 0
    while pos < len(data):
        if pos + 12 > len(data):
            return pos
        (length,) = struct.unpack_from("<Q", data, pos)
        if struct.unpack_from("<I", data, pos + 8)[0] != masked_crc32c(data[pos:pos + 8]):
            raise BitdetInputError(f"{event_file}: corrupt record at byte {pos} (length CRC mismatch)")
        if pos + 12 + length + 4 > len(data):
            return pos
        body = data[pos + 12:pos + 12 + length]
        if struct.unpack_from("<I", data, pos + 12 + length)[0] != masked_crc32c(body):
            raise BitdetInputError(f"{event_file}: corrupt record at byte {pos} (data CRC mismatch)")
        pos += 12 + length + 4
    return None


def load_tensorboard(path: Path, config: TensorBoardConfig = TensorBoardConfig(), *,
                     allow_truncated: bool = False) -> RunData:
    """All scalars of one log dir, per step, each encoded as float32; by-nature-variable tags hidden.
    An event file whose last record is cut short is unusable input unless ``allow_truncated``."""
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        raise BitdetInputError(
            "reading TensorBoard logs needs the 'tensorboard' package: pip install tensorboard"
        ) from None
    warnings, truncated = [], []
    for event_file in sorted(path.glob("events.out.tfevents.*")):
        offset = truncated_at(event_file)
        if offset is None:
            continue
        message = f"{event_file}: truncated record at byte {offset} (the writer stopped mid-record)"
        if not allow_truncated:
            raise BitdetInputError(f"{message}; pass --allow-truncated to compare the steps before it")
        warnings.append(f"{message}: ignored (--allow-truncated)")
        truncated.append(event_file)
    acc = event_accumulator.EventAccumulator(str(path), size_guidance={event_accumulator.SCALARS: 0})
    try:
        acc.Reload()
    except Exception as exc:  # tensorboard's own parser: any failure on these bytes is bad input
        raise BitdetInputError(f"{path}: unreadable TensorBoard event files: {type(exc).__name__}: {exc}") from None
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
        hidden=frozenset(t for t in tags if _excluded(t, config)), warnings=warnings, truncated=truncated,
    )


def _excluded(tag: str, config: TensorBoardConfig) -> bool:
    return any(fnmatch.fnmatch(tag.lower(), pat) for pat in config.exclude)
