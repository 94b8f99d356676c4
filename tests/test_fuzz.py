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


HUGE = "9" * 5000  # past Python's 4300-digit int-parsing limit: a ValueError no JSON/YAML error class covers
DEEP_JSON, DEEP_YAML = "[" * 100_000 + "]" * 100_000, "[" * 5000 + "]" * 5000  # past the recursion limit
BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefg", "bcdefgh"))


def test_structural_inputs_exit_2_naming_the_file(tmp_path, saved_checkpoint, capsys):
    """What byte flips never make: an over-long integer, nesting deeper than the stack, a YAML alias bomb
    (a "billion laughs": 10^7 expansions in 300 bytes), a directory where a file belongs. Each input kind
    exits 2 naming its file (or the override), fast, with no traceback."""
    from test_compare import write_run

    recipe = tmp_path / "recipe.yaml"
    base = Path(RECIPE).read_text()
    cases = []
    for name, text in (("hugeint", base + f"zz: {HUGE}\n"), ("deep", base + f"zz: {DEEP_YAML}\n"),
                       ("bomb", "a: &a [x]\n" + BOMB)):
        cases.append((f"recipe {name}", lambda text=text: recipe.write_text(text),
                      ["recipe", "validate", str(recipe)], str(recipe)))
    for name, value in (("hugeint", HUGE), ("deep", DEEP_YAML)):
        cases.append((f"override {name}", lambda: None, ["recipe", "validate", str(RECIPE), f"training.iterations={value}"],
                      "<override 'training.iterations="))
    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
    fp, manifest = b / "fingerprints" / "rank_00000.jsonl", b / "manifest.json"
    good_fp, good_manifest = fp.read_text(), manifest.read_text()

    def fingerprint(text):
        fp.unlink() if fp.is_file() else fp.rmdir()
        fp.mkdir() if text is None else fp.write_text(text + good_fp)

    for name, text in (("hugeint", f'{{"zz": {HUGE}}}\n'), ("deep", DEEP_JSON + "\n"), ("directory", None)):
        cases.append((f"fingerprint {name}", lambda text=text: fingerprint(text), ["compare", str(a), str(b)], str(fp)))
    for name, text in (("hugeint", good_manifest[:-1] + f', "zz": {HUGE}}}'), ("deep", DEEP_JSON)):
        cases.append((f"manifest {name}", lambda text=text: (fingerprint(""), manifest.write_text(text)),
                      ["compare", str(a), str(b)], str(manifest)))
    report_dir = tmp_path / "vr"
    report_dir.mkdir()
    for name, text in (("hugeint", f'{{"points": [], "holds": {HUGE}}}'), ("deep", DEEP_JSON)):
        cases.append((f"verify_resume.json {name}", lambda text=text: (report_dir / "verify_resume.json").write_text(text),
                      ["doctor", str(report_dir)], "verify_resume.json"))
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(saved_checkpoint, ckpt / saved_checkpoint.name)
    load = ["train", "--recipe", str(RECIPE), "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--load", str(ckpt)]
    cases.append(("checkpoint latest hugeint", lambda: (ckpt / "latest").write_text(HUGE), load, str(ckpt / "latest")))
    meta = ckpt / saved_checkpoint.name / "bitdet_meta.json"
    for name, text in (("hugeint", f'{{"files": {HUGE}}}'), ("deep", DEEP_JSON)):
        cases.append((f"checkpoint meta {name}", lambda text=text: ((ckpt / "latest").unlink(missing_ok=True),
                                                                   meta.write_text(text)),
                      [*load[:-1], str(ckpt / saved_checkpoint.name)], str(meta)))
    for label, prepare, argv, where in cases:
        prepare()
        capsys.readouterr()
        assert main(argv) == 2, label
        err = capsys.readouterr().err
        assert where in err, (label, err[-2000:])
    assert not (tmp_path / "run").exists()  # nothing was launched
