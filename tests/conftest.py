"""Shared real training runs: every 2-rank launch costs ~20 s here, so each run is made once per
session and read by every test that needs it (test_train, test_checkpoint)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "nemotron_h_tiny.yaml"
ITERATIONS = 4  # > warmup_iters (2)
RESUME_AT = 2  # the reference saves every step; the resumed run restores 2 and runs 3-4 (both at lr > 0)


@dataclass(frozen=True)
class Run:
    dir: Path
    rc: int

    def fingerprint_bytes(self, rank: int) -> bytes:
        return (self.dir / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()

    def fingerprint_lines(self, rank: int) -> list[bytes]:
        return self.fingerprint_bytes(rank).splitlines(keepends=True)

    def steps(self, rank: int) -> list[dict]:
        return [json.loads(line) for line in self.fingerprint_lines(rank)]

    def manifest(self) -> dict:
        return json.loads((self.dir / "manifest.json").read_text())


def train(run_dir: Path, *overrides: str, **launch_kwargs) -> Run:
    """One real 2-rank gloo training run of the tiny hybrid recipe (in-process launcher, spawned ranks)."""
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.train.run import RunOptions, launch_training

    recipe = load_recipe(str(RECIPE), [f"training.iterations={ITERATIONS}", *overrides])
    return Run(run_dir, launch_training(recipe, RunOptions(nproc=2, run_dir=run_dir, **launch_kwargs)))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Run:
    """The default recipe (EP2, alltoall, distributed optimizer): a checkpoint every step, a live
    snapshot at RESUME_AT."""
    return train(tmp_path_factory.mktemp("reference"), save_interval=1, snapshot_at=[RESUME_AT])


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory, reference_run) -> Run:
    """Resumes the reference from its checkpoint at RESUME_AT (snapshot right after the restore)."""
    assert reference_run.rc == 0
    load = reference_run.dir / "checkpoints" / f"iter_{RESUME_AT:07d}"
    return train(tmp_path_factory.mktemp("resumed"), load=str(load), snapshot_at=[RESUME_AT])


@pytest.fixture(scope="session")
def saved_checkpoint(reference_run) -> Path:
    """One real checkpoint directory (the reference's iteration RESUME_AT) for tests that read it or
    corrupt it; copy it before changing anything."""
    assert reference_run.rc == 0
    return reference_run.dir / "checkpoints" / f"iter_{RESUME_AT:07d}"
