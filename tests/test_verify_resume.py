"""verify-resume on real 2-rank gloo training: a correct chain holds; restores that skip a
component (test-only fault injection in the worker) are named by component, rank, key and the
first step whose outputs differ. One reference run and one correct chain are shared by every test of
this module; the faulted chains continue from the correct chain's fresh segment (0 -> 2).

The shared recipe has dropout on (attention and hidden): attention dropout draws from megatron's
tracker ("model-parallel-rng" fork) and hidden dropout from the default torch generator, so a
correct resume must restore both exactly, and a skipped tracker restore changes later outputs.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import faulted_chain
from megatron_bitdet.workflows.resume import (bitwise_equal, check_resume_at, recipe_segment, run_chain,
                                             run_reference, verify_resume)
from megatron_bitdet.cli import main
from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "nemotron_h_tiny.yaml")
OVERRIDES = ["training.iterations=6", "model.attention_dropout=0.1", "model.hidden_dropout=0.1"]
STATE = {"parameters", "buffers", "optimizer", "scheduler", "rng.python", "rng.numpy", "rng.torch_cpu",
         "rng.tracker", "data"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(RECIPE, OVERRIDES)


@pytest.fixture(scope="module")
def reference(recipe, tmp_path_factory):
    return run_reference(recipe, [2, 3, 4], nproc=2, run_dir=tmp_path_factory.mktemp("vr") / "reference")


@pytest.fixture(scope="module")
def correct_chain(recipe, reference, tmp_path_factory):
    return verify_resume(recipe, [2, 4], nproc=2, out_dir=tmp_path_factory.mktemp("chain"), reference_dir=reference)


def test_correct_chain_holds_component_by_component(correct_chain, reference):
    report = correct_chain
    assert report.holds, report.summary()
    # digests only: no full-state file anywhere, no second pass (nothing differed)
    out = Path(report.out_dir)
    assert not [p for d in (out, Path(reference)) for p in d.rglob("*.pt") if "snapshots" in p.parts]
    assert not list(out.glob("second_pass_*"))
    assert len(list(Path(reference).glob("snapshots/iter_*/rank_*.json"))) == 3 * 2
    assert report.first_output_divergence == {2: None, 4: None}
    assert [p.steps_compared for p in report.points] == [[1, 2], [3, 4], [5, 6]]
    for step in (2, 4):
        for rank in (0, 1):
            assert {c.component for c in report.checks if c.resume_step == step and c.rank == rank} == STATE
    tracker = {c.key for c in report.checks if c.component == "rng.tracker"}
    assert "model-parallel-rng" in tracker
    assert all(c.equal for c in report.checks)  # every leaf, optimizer steps included
    assert json.loads(json.dumps(report.to_json()))["holds"] is True
    assert report.summary().startswith("HOLDS")


@pytest.mark.parametrize("fault, component, key, cause", [
    ("rng.tracker", "rng.tracker", "model-parallel-rng", "rng_not_restored"),
    ("data", "data", "consumed_samples", "data_position_not_restored"),
])
def test_skipped_restore_is_named(recipe, reference, correct_chain, tmp_path, fault, component, key, cause, capsys):
    report = faulted_chain(recipe, [2], [fault], fresh_segment=correct_chain.points[0].run_dir,
                           reference_dir=reference, out_dir=tmp_path)
    assert not report.holds
    assert not any(c.by_digest for c in report.checks)  # every difference counted
    fresh, resumed = report.points
    assert fresh.holds  # the segment before any restore matches the reference
    assert resumed.failing_components == [component]
    bad = report.failures
    assert {c.rank for c in bad} == {0, 1}
    assert any(c.key == key for c in bad), [c.key for c in bad]
    assert report.first_output_divergence == {2: 3} and resumed.diverged_steps == [3, 4, 5, 6]
    assert f"{component} differs" in report.summary() and "first differ at step 3" in report.summary()
    # the doctor reads the saved report: the catalog entry for the skipped restore ranks first
    assert main(["doctor", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.startswith("1. ["))
    assert first.startswith(f"1. [{cause}]"), out
    assert f"restored state differs: {component}" in out and "first divergent step: after_restore" in out


def test_segment_that_restored_nothing_is_not_a_resume(recipe, reference, tmp_path):
    """A 'resumed' segment that ignores its checkpoint and trains from step 1 (what a launch does whose
    --load finds nothing) has the same live state at K and the same later outputs as the reference:
    only its own fingerprints, steps 1..K included, show that nothing was restored."""
    segment = recipe_segment(recipe, nproc=2)

    def from_scratch(run_dir, start, stop, load_from):
        segment(run_dir, start, stop, None)  # the checkpoint to load is dropped

    with pytest.raises(BitdetError, match=r"resumed at step 2 but rank 0's fingerprints hold steps 1-6, expected "
                                          r"3-6: it ran steps before its resume point, so nothing was restored"):
        run_chain(from_scratch, name=recipe.name, steps=[2], iterations=6, nproc=2, out_dir=tmp_path,
                  reference_dir=reference, faults=[])


def test_cli_skipped_optimizer_moment_exits_1_with_json(reference, tmp_path, capsys):
    rc = main(["verify-resume", "--recipe", RECIPE, "--resume-at", "3", "--out", str(tmp_path), "--reference",
               str(reference), "--json", "--fault-skip-restore", "optimizer.exp_avg", *OVERRIDES])
    captured = capsys.readouterr()
    assert rc == 1, captured.err[-3000:]
    out = json.loads(captured.out[captured.out.index("{\n"):])
    assert out["holds"] is False and out["first_output_divergence"] == {"3": 4}
    bad = [c for c in out["checks"] if not c["equal"]]
    assert {c["component"] for c in bad} == {"optimizer"}
    assert bad and all(c["key"].endswith(".exp_avg") for c in bad)
    assert "elements differ" in bad[0]["detail"] and not any(c["by_digest"] for c in bad)
    # the counts came from a targeted second pass: both sides re-run to 3, keeping only those tensors in full
    from megatron_bitdet.rundir import snapshot_full_path
    from megatron_bitdet.train.snapshot import read_full

    second = tmp_path / "second_pass_0000003"
    for side in ("reference", "resumed"):
        for rank in (0, 1):
            kept = read_full(snapshot_full_path(second / side, 3, rank))
            assert set(kept) == {(c["component"], c["key"]) for c in bad if c["rank"] == rank}
    # the chain's own snapshots stay digests
    assert not [p for p in tmp_path.rglob("*.pt") if "snapshots" in p.parts and second not in p.parents]


def test_bad_resume_at_exits_2_without_launching(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_bitdet", "verify-resume", "--recipe", RECIPE, "--resume-at", "4,2",
         "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert proc.returncode == 2
    assert "strictly increasing, got 4 then 2" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("text, message", [
    ("0", "not an iteration in 1..7"), ("8", "not an iteration in 1..7"), ("3,3", "strictly increasing"),
    ("two", "expected comma-separated iterations"), (",", "no iterations"),
])
def test_bad_resume_at_in_process(tmp_path, capsys, text, message):
    assert main(["verify-resume", "--recipe", RECIPE, "--resume-at", text, "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_unusable_reference_and_fault_are_refused_before_launching(recipe, reference, tmp_path):
    with pytest.raises(BitdetInputError, match="no live-state snapshot for iteration 5"):
        verify_resume(recipe, [5], nproc=2, out_dir=tmp_path, reference_dir=reference)
    with pytest.raises(BitdetInputError, match="different recipe"):
        verify_resume(load_recipe(RECIPE, ["training.iterations=6"]), [2], nproc=2, out_dir=tmp_path,
                      reference_dir=reference)
    with pytest.raises(BitdetInputError, match="ran on 2 ranks, not --nproc 1"):
        verify_resume(recipe, [2], nproc=1, out_dir=tmp_path, reference_dir=reference)
    with pytest.raises(BitdetInputError, match="unknown restore fault"):
        verify_resume(recipe, [2], nproc=2, out_dir=tmp_path, reference_dir=reference, faults=["rng.everything"])
    assert not list(tmp_path.iterdir())
    with pytest.raises(BitdetInputError):
        check_resume_at([True], 6)


def test_corrupt_or_misplaced_reference_snapshot_is_refused_before_training(recipe, reference, tmp_path):
    """A reused reference's snapshots are read before any segment trains: a truncated file or one of
    another step was a traceback (or a silent step mix-up) only after the whole chain had trained."""
    import shutil

    from megatron_bitdet.rundir import snapshot_path

    copy = tmp_path / "reference"
    shutil.copytree(reference, copy)
    victim = snapshot_path(copy, 2, 1)
    good = victim.read_text()
    victim.write_text(good[:100])
    with pytest.raises(BitdetInputError, match=r"rank_00001.json: not a live-state snapshot \(corrupt JSON\)"):
        verify_resume(recipe, [2], nproc=2, out_dir=tmp_path / "out", reference_dir=copy)
    shutil.copyfile(snapshot_path(copy, 3, 1), victim)
    with pytest.raises(BitdetInputError, match="the snapshot is of step 3 rank 1"):
        verify_resume(recipe, [2], nproc=2, out_dir=tmp_path / "out", reference_dir=copy)
    data = json.loads(good)  # one chunk digest dropped from a tensor: a truncated leaf, never a shorter comparison
    leaf = next(e for e in data["leaves"] if isinstance(e[2], dict) and "tensor" in e[2])
    leaf[2]["tensor"]["chunks"].pop()
    victim.write_text(json.dumps(data))
    with pytest.raises(BitdetInputError, match=r"rank_00001.json: leaves\[\d+\] holds \d+ chunk digests"):
        verify_resume(recipe, [2], nproc=2, out_dir=tmp_path / "out", reference_dir=copy)
    victim.write_bytes(b"\xff\xfe" + good.encode())
    assert main(["verify-resume", "--recipe", RECIPE, "--resume-at", "2", "--out", str(tmp_path / "out"),
                 "--reference", str(copy), *OVERRIDES]) == 2
    assert not (tmp_path / "out").exists()


def test_tensor_digests_see_one_bit_in_any_chunk_and_not_where_the_tensor_lies():
    """Snapshot digests: one flipped bit changes exactly its chunk's digest; the same bytes at an
    unaligned storage offset (a parameter inside a DDP buffer) digest the same as a fresh copy."""
    from megatron_bitdet.train.snapshot import CHUNK_BYTES, tensor_digest

    x = torch.randn(3 * CHUNK_BYTES // 4 + 5)  # three whole chunks and a 20-byte tail
    base = tensor_digest(x)
    assert len(base.chunks) == 4
    for element in (0, CHUNK_BYTES // 4 + 7, x.numel() - 1):
        y = x.clone()
        y.view(torch.int32)[element] ^= 1 << 30
        assert base.differing_chunks(tensor_digest(y)) == [element * 4 // CHUNK_BYTES]
    buf = torch.randn(1001, dtype=torch.bfloat16)
    assert tensor_digest(buf[1:]) == tensor_digest(buf[1:].clone())
    assert tensor_digest(buf[1:]) != tensor_digest(buf[:-1])
    assert not bitwise_equal(base, tensor_digest(x.view(-1)[:-1]))[0]  # another shape


def test_bitwise_equal_is_bits_not_values():
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    y = x.clone()
    y.view(torch.int32)[2, 1] ^= 1  # one flipped low mantissa bit
    assert bitwise_equal(x, x.clone()) == (True, "")
    equal, detail = bitwise_equal(x, y)
    assert not equal and detail.startswith("1 of 12 elements differ; first at [2, 1]")
    assert not bitwise_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))[0]
    assert not bitwise_equal(torch.zeros(2), -torch.zeros(2))[0]  # -0.0 == 0.0 numerically
    nan = torch.tensor([math.nan])
    assert bitwise_equal(nan, nan.clone())[0]  # same NaN bits are equal (NaN != NaN numerically)
    assert bitwise_equal(torch.tensor([True, False]), torch.tensor([True, False]))[0]
    assert not bitwise_equal(0.0, -0.0)[0] and bitwise_equal(math.nan, math.nan)[0]
    assert not bitwise_equal(1, True)[0] and not bitwise_equal(1, 1.0)[0]
    assert bitwise_equal({"a": 1}, {"a": 1})[0] and bitwise_equal(None, None)[0]


@pytest.mark.timeout(600)
def test_model_with_its_own_generator_is_restored_and_holds(tmp_path, monkeypatch):
    """A module drawing from its own torch.Generator (tests/generator_provider.py): the checkpoint
    carries the generator, the restore sets it, the snapshot compares it, and the resume holds."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    small = load_recipe(RECIPE, ["training.iterations=3", "parallel.expert=1"])
    report = verify_resume(small, [2], nproc=1, out_dir=tmp_path, model_provider="generator_provider:provider")
    assert report.holds, report.summary()
    generator = [c for c in report.checks if c.component == "rng.module:0.noise:gen"]
    assert len(generator) == 1 and generator[0].equal
    buffers = {c.key for c in report.checks if c.component == "buffers"}
    assert any(k.endswith("router.expert_bias") for k in buffers), buffers  # router_expert_bias: true
    lines = [json.loads(x) for x in (Path(report.points[1].run_dir) / "fingerprints" / "rank_00000.jsonl").open()]
    assert [line["step"] for line in lines] == [3] and {"buffers", "generators"} <= set(lines[0]["digests"])
