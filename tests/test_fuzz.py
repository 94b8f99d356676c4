"""Seeded fuzzing of every input file kind: random byte flips, truncations, non-UTF-8 bytes, empty files.

Recipes, fingerprint files, traces, manifests and checkpoint files (bitdet_meta.json and the shards)
from real runs go through the real CLI in this process. Never a traceback (any exception but a clean
exit fails the test); changed checkpoint or fingerprint bytes never exit 0. The counts per kind
(cases, exit codes) are printed (``pytest -s``)."""
from __future__ import annotations

import collections
import random
import shutil
from pathlib import Path

import pytest

from conftest import ITERATIONS, RECIPE
from megatron_bitdet.cli import main

SEED = 20261201
CASES = 12  # per mutation kind and file


def mutations(data: bytes, rng: random.Random):
    """(name, mutated bytes): each differs from ``data``."""
    for _ in range(CASES):
        pos = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[pos] ^= rng.randrange(1, 256)
        yield "flip", bytes(flipped)
        yield "truncate", data[:rng.randrange(len(data))]
        pos = rng.randrange(len(data) + 1)
        yield "non_utf8", data[:pos] + rng.choice([b"\xff", b"\xfe\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80"]) + data[pos:]
    yield "empty", b""


def fuzz(path: Path, run, tally: collections.Counter, *, never_zero: bool) -> None:
    """Run ``run()`` (a CLI exit code) on every mutation of ``path``; restore the file afterwards."""
    original = path.read_bytes()
    rng = random.Random(f"{SEED}:{path.name}")
    try:
        for kind, data in mutations(original, rng):
            path.write_bytes(data)
            code = run()
            tally[(kind, code)] += 1
            assert code in (0, 1, 2), (path.name, kind, code)
            if never_zero:
                assert code != 0, f"{path.name}: a {kind} mutation was accepted (exit 0)"
    finally:
        path.write_bytes(original)


def report(name: str, tally: collections.Counter) -> None:
    codes = collections.Counter()
    for (_, code), n in tally.items():
        codes[code] += n
    print(f"\nfuzz {name}: {sum(tally.values())} cases, exit codes {dict(sorted(codes.items()))}")


def test_fuzz_recipes(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    shutil.copyfile(RECIPE, recipe)
    tally = collections.Counter()
    fuzz(recipe, lambda: main(["recipe", "validate", str(recipe)]), tally, never_zero=False)
    with capsys.disabled():
        report("recipes", tally)
    assert "Traceback" not in capsys.readouterr().err


def test_fuzz_fingerprints_and_manifest(reference_run, tmp_path, capsys):
    b = tmp_path / "b"
    shutil.copytree(reference_run.dir, b, ignore=shutil.ignore_patterns("checkpoints", "snapshots"))
    compare = lambda: main(["compare", str(reference_run.dir), str(b)])  # noqa: E731
    fingerprints, manifests = collections.Counter(), collections.Counter()
    for rank in (0, 1):
        fuzz(b / "fingerprints" / f"rank_{rank:05d}.jsonl", compare, fingerprints, never_zero=True)
    fuzz(b / "manifest.json", compare, manifests, never_zero=False)  # created/argv are not in the scope
    with capsys.disabled():
        report("fingerprint files", fingerprints)
        report("manifests", manifests)
    assert compare() == 0  # restored: the copy matches again


def test_fuzz_traces(tmp_path, capsys):
    from test_localize import run_planted

    from megatron_bitdet.trace import trace_path

    run_planted(tmp_path / "a", 1)
    run_planted(tmp_path / "b", 1)
    localize = lambda: main(["localize", "--traces-only", "--workers", "1", str(tmp_path / "a"), str(tmp_path / "b")])  # noqa: E731
    tally = collections.Counter()
    fuzz(trace_path(tmp_path / "b", 0), localize, tally, never_zero=False)
    with capsys.disabled():
        report("traces", tally)
    assert localize() == 0


@pytest.mark.timeout(300)
def test_fuzz_checkpoint_files(saved_checkpoint, tmp_path, capsys):
    """Every changed byte of bitdet_meta.json or a shard is refused before any rank starts (the same
    verification every rank repeats when it loads)."""
    ckpt = tmp_path / saved_checkpoint.name
    shutil.copytree(saved_checkpoint, ckpt)
    run_dir = tmp_path / "run"
    resume = lambda: main(["train", "--recipe", str(RECIPE), "--nproc", "2", "--run-dir", str(run_dir),  # noqa: E731
                           "--load", str(ckpt), f"training.iterations={ITERATIONS}"])
    files = [ckpt / "bitdet_meta.json", *sorted(p for p in ckpt.iterdir() if p.name != "bitdet_meta.json")]
    tally = collections.Counter()
    for path in files:
        fuzz(path, resume, tally, never_zero=True)
    with capsys.disabled():
        report(f"checkpoint files ({len(files)} files)", tally)
    assert not run_dir.exists()  # nothing was launched
