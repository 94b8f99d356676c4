"""From divergence to validated fix on a thread-ordered accumulation (docs/localize.md's worked example, its
commands as written): megatron's deterministic embedding path without torch's deterministic algorithms, whose
backward adds repeated token rows in thread order on 2 threads. Planted (examples.planted_nondeterminism:
thread_order_provider, the rows summed in an os.urandom order): the real index_put_(accumulate=True) does the
same only while two threads add into one row at the same moment, which a CPU need not do in a given run.

A pair of runs diverges; `bitdet localize` climbs to the op and ends with the kernel rung (the op's
inputs captured in both re-runs, replayed in a fresh process: thread dependence and torch's
deterministic variant named); `bitdet fixcheck --fix determinism.mode=true` reuses that pair and its
ladder, runs the fixed pair (bit-identical over every step), classifies the fix and measures its tax
interleaved; a non-fix exits 1; `bitdet doctor` names the catalog entry from the saved evidence."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_bitdet.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/nemotron_h_tiny.yaml"
PROVIDER = "examples.planted_nondeterminism:thread_order_provider"
OP = "bitdet_example.thread_order_index_add.default"
ORIGINAL = ["determinism.mode=false", "training.iterations=2", "training.lr_schedule.warmup_iters=1"]
pytestmark = pytest.mark.timeout(900)


def train_argv(run_dir):
    return ["train", "--recipe", RECIPE, "--nproc", "2", "--run-dir", str(run_dir), "--model-provider", PROVIDER,
            *ORIGINAL]


def localize_argv(a, b):
    return ["localize", str(a), str(b), "--levels", "op"]


def fixcheck_argv(out):
    return ["fixcheck", "--recipe", RECIPE, "--model-provider", PROVIDER, *ORIGINAL, "--fix", "determinism.mode=true",
            "--out", str(out), "--reuse-original", "--tax-rounds", "2", "--tax-warmup", "0"]


def doctor_argv(a, b):
    return ["doctor", str(a), str(b), "--offline"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """OUT/original/run_0 and run_1: the pair fixcheck --reuse-original finds (run side by side)."""
    out = tmp_path_factory.mktemp("fixcheck")
    cwd = os.getcwd()
    os.chdir(ROOT)  # ranks, ladder and replay import the example provider from the repository root
    try:
        def train(i):
            return main(train_argv(out / "original" / f"run_{i}"))
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(train, range(2))) == [0, 0]
        yield out
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def localized(base):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(localize_argv(base / "original" / "run_0", base / "original" / "run_1"))
    (base / "localize.out").write_text(buf.getvalue())  # kept with the runs: the worked example's output
    return rc, buf.getvalue()


@pytest.fixture(scope="module")
def fixed(base, localized):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(fixcheck_argv(base))
    (base / "fixcheck.out").write_text(buf.getvalue())
    return rc, buf.getvalue(), json.loads((base / "fixcheck.json").read_text())


def test_localize_ends_with_the_kernel_rung_verdict(localized, base):
    rc, out = localized
    assert rc == 1, out
    assert f"culprit: {OP} in module embedding.word_embeddings" in out
    kernel = next(line for line in out.splitlines() if line.startswith("kernel:"))
    assert f"kernel:  {OP} — " in kernel
    assert "at 1 thread" in kernel and "depends on thread scheduling" in kernel
    assert "torch has a deterministic variant" in kernel
    assert "[parallel_accumulation_thread_order]" in out
    saved = json.loads((base / "original" / "run_0" / "ladder" / "result.json").read_text())
    by = {c["label"]: c for c in saved["kernel"]["configs"]}
    assert by["1 thread"]["distinct"] == 1 and by["deterministic algorithms (2 threads)"]["distinct"] == 1
    assert max(c["distinct"] for c in saved["kernel"]["configs"] if c["threads"] > 1 and not c["label"].startswith("det")) > 1


def test_fixcheck_validates_classifies_and_measures_the_fix(fixed):
    rc, out, result = fixed
    assert rc == 0, out
    assert "original diverges, fixed matches" in out
    assert f"original diverges (step 1, {OP}), fixed matches bitwise over 2 steps" in out
    assert "fix:       corrects the implementation" in out
    assert result["kind"] == "corrects" and [c["key"] for c in result["changes"]] == ["determinism.mode"]
    assert result["fixed"]["matched"] and all(p["complete"] and p["steps_compared"] == 2 for p in result["fixed"]["pairs"])
    assert result["original"]["diverged"] and any("reused 2 original run(s)" in n for n in result["notes"])
    t = result["tax"]
    assert t["rounds"] == 2 and t["fixed_ms"] > 0 and t["original_ms"] > 0 and "tax:       " in out


def test_a_non_fix_exits_1(base, fixed):
    rc = main(["fixcheck", "--recipe", RECIPE, "--model-provider", PROVIDER, *ORIGINAL, "--fix", "training.seed=4321",
               "--out", str(base), "--reuse-original", "--no-localize"])
    assert rc == 1
    result = json.loads((base / "fixcheck.json").read_text())
    assert result["original"]["diverged"] and not result["fixed"]["matched"] and not result["ok"]
    assert result["tax"] is None and "tax not measured: the fix was not validated" in result["notes"]


def test_doctor_names_the_entry_from_the_saved_evidence(base, localized, capsys):
    rc = main(doctor_argv(base / "original" / "run_0", base / "original" / "run_1"))
    out = capsys.readouterr().out
    assert rc == 1
    assert out.splitlines()[out.splitlines().index("likely causes, best first:") + 1].startswith(
        "1. [parallel_accumulation_thread_order]")
    assert "evidence: kernel rung: thread_scheduling" in out and "next: bitdet fixcheck" in out


def test_fixcheck_bad_input_exits_2(tmp_path):
    assert main(["fixcheck", "--recipe", RECIPE, "--out", str(tmp_path)]) == 2  # no fix given
    assert main(["fixcheck", "--recipe", RECIPE, "--fix", "model.nope=1", "--out", str(tmp_path)]) == 2
    assert main(["fixcheck", "--recipe", RECIPE, "--fix-env", "NOEQUALS", "--out", str(tmp_path)]) == 2
    assert main(["fixcheck", "--recipe", RECIPE, "--fix", "determinism.mode=true", "--runs", "1",
                 "--out", str(tmp_path)]) == 2


def documented_commands() -> list[list[str]]:
    """The worked example's `bitdet` commands in docs/localize.md, $P and $ORIG expanded, as argv."""
    import re
    import shlex

    text = (ROOT / "docs" / "localize.md").read_text()
    section = text[text.index("## From divergence to a validated fix"):]
    script = "\n".join(re.findall(r"```bash\n(.*?)```", section, re.S)).replace("\\\n", " ")
    names = dict(re.findall(r"^(P|ORIG)=(.*)$", script, re.M))
    commands = []
    for line in script.splitlines():
        if "bitdet " in line:
            command = line[line.index("bitdet ") + len("bitdet "):].split(";")[0]
            for name, value in names.items():
                command = command.replace(f"${name}", " ".join(shlex.split(value)))
            commands.append(shlex.split(command))
    return commands


def test_the_documented_commands_are_the_ones_tested():
    """docs/localize.md's worked example runs (paths aside) exactly what the fixtures above run."""
    base = "runs/fc"
    assert documented_commands() == [
        train_argv(f"{base}/original/run_$i"), localize_argv(f"{base}/original/run_0", f"{base}/original/run_1"),
        fixcheck_argv(base), doctor_argv(f"{base}/original/run_0", f"{base}/original/run_1")]
