"""A run as every comparison sees it, whichever format it was read from (bitdet run dir, TensorBoard)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from megatron_bitdet.fingerprint.steps import StepRecord


@dataclass
class RunData:
    """A run as comparisons see it: per rank, the step records in increasing step order."""

    path: Path
    format: str  # "bitdet" | "tensorboard"
    ranks: dict[int, list[StepRecord]]
    files: dict[int, Path]
    manifest: dict | None = None
    hidden: frozenset[str] = frozenset()  # names compared only when asked for by name
    warnings: list[str] = field(default_factory=list)
    truncated: list[Path] = field(default_factory=list)  # files cut short, read up to the cut (--allow-truncated)

    def steps(self, rank: int) -> list[int]:
        return [r.step for r in self.ranks[rank]]
