"""The per-step digests on real gloo ranks of the tiny hybrid: no host read and no host-blocking op
(scalar read, data-sized output) from bitdet's code inside a step (bitdet's loop and Megatron-LM's launch, the device path on CPU tensors),
bytes per rank halving from DP 1 to 2 to 4, every buffer kind's flipped bit seen (a planted flip in one
replica named by ``bitdet check``: tests/test_replica_check.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import host_sync_recorder
from conftest import RECIPE, REPO
from megatron_bitdet.cli import main as bitdet

TESTS = Path(__file__).resolve().parent

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
CPU_ONLY = {"Tensor.numpy", "Tensor.__array__"}
CPU_BACKEND = "/megatron_bitdet/compat/cpu_backend/"


@pytest.fixture
def test_workers(monkeypatch):
    """Ranks import this directory's worker modules."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))


def run(tmp_path, *overrides, nproc=2, worker=None, worker_args=None, iterations=3):
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.train.run import WORKER, RunOptions, launch_training

    recipe = load_recipe(str(RECIPE), [f"training.iterations={iterations}", *overrides])
    return launch_training(recipe, RunOptions(nproc=nproc, run_dir=tmp_path), worker=worker or WORKER,
                           worker_args=worker_args)


def lines(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "fingerprints" / f"rank_{rank:05d}.jsonl").read_text().splitlines()]


def assert_no_host_sync_from_bitdet_in_a_step(record_dir: Path, steps: int) -> None:
    """No host read or host-blocking op from bitdet's code inside a step, of any tensor: training state
    or not (a read of the digests' own results blocks the step on a GPU as much as one of the params).
    A numpy view (``.numpy()``, ``__array__``) of a tensor that is not training state is a CPU-only
    path (``kernels.moe_aux``'s tree levels): it raises on a device tensor, so it never transfers. The
    CPU backend's seams stand in for megatron's CUDA-only code and are never installed on a GPU: their
    host copies are megatron's own (the alltoall dispatcher's split sizes, which it copies on a GPU too)."""
    events = host_sync_recorder.read(record_dir)
    in_step = [e for e in events if e["in_step"]]
    # the recorder sees the step: megatron's own scalar reads in it (the grad norm, the loss report)
    assert any(not e["bitdet"] for e in in_step), "the recorder saw no step"
    bad = [e for e in in_step if e["bitdet"] and CPU_BACKEND not in e["caller"]
           and (e["op"] not in CPU_ONLY or e["state"])]
    assert not bad, f"{len(bad)} host transfers / host syncs from bitdet's code inside a step, first: {bad[:3]}"
    # and after it: the digests read back once a step per rank, at the log point
    reads = [e for e in events if e["bitdet"] and "/fingerprint/shards.py:" in e["caller"] and e["op"] == "Tensor.tolist"]
    assert len(reads) >= steps


@pytest.mark.timeout(300)
def test_bitdet_loop_makes_no_host_copy_or_scalar_read_in_a_step(tmp_path, monkeypatch, test_workers):
    """The device path (what runs on a GPU) on CPU tensors, both the sharded params and the owned grads."""
    monkeypatch.setenv("BITDET_DIGESTS", "device")
    monkeypatch.setenv("BITDET_RECORD_DIR", str(tmp_path / "record"))
    assert run(tmp_path / "run", "parallel.expert=1", worker="fingerprint_workers:recorded") == 0
    assert_no_host_sync_from_bitdet_in_a_step(tmp_path / "record", steps=3)
    for rank in (0, 1):
        assert all(d.startswith("pos64r:") for step in lines(tmp_path / "run", rank) for d in step["digests"].values())


@pytest.mark.megatron_lm
@pytest.mark.timeout(300)
def test_megatron_lm_launch_makes_no_host_copy_or_scalar_read_in_a_step(tmp_path, monkeypatch, test_workers):
    """Megatron-LM's pretrain_mamba.py through bitdet's entry, recorded from its first line
    (tests/megatron_lm_recorded.py runs the recorder, then the script)."""
    from test_megatron_lm import MAMBA

    monkeypatch.setenv("BITDET_DIGESTS", "device")
    monkeypatch.setenv("BITDET_RECORD_DIR", str(tmp_path / "record"))
    monkeypatch.setenv("BITDET_RECORDED_SCRIPT", os.path.join(MEGATRON_LM, "pretrain_mamba.py"))
    scripts = tmp_path / "scripts"  # the recorded script beside a link to Megatron-LM's megatron package
    scripts.mkdir()
    (scripts / "megatron").symlink_to(Path(MEGATRON_LM) / "megatron")
    (scripts / "megatron_lm_recorded.py").symlink_to(TESTS / "megatron_lm_recorded.py")
    rc = bitdet(["megatron-lm", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                 str(scripts / "megatron_lm_recorded.py"), *MAMBA])
    assert rc == 0
    assert_no_host_sync_from_bitdet_in_a_step(tmp_path / "record", steps=3)
    assert [s["step"] for s in lines(tmp_path / "run", 0)] == [1, 2, 3]


def rank_bytes(line: dict) -> dict[str, tuple[int, int]]:
    """kind -> (own bytes, checked bytes) a line's slices cover."""
    out: dict[str, list[int]] = {}
    for rec in line["slices"]:
        n = sum(hi - lo for lo, hi, _ in rec["parts"])
        out.setdefault(rec["kind"], [0, 0])[1 if "check_of" in rec else 0] += n
    return {k: tuple(v) for k, v in out.items()}


@pytest.mark.timeout(600)
def test_bytes_digested_per_rank_halve_from_dp1_to_dp2_to_dp4(tmp_path):
    """params (replicated: a slice each, plus one chunk of the next replica's) and grads (the shard the
    distributed optimizer gives each rank) on 1, 2 and 4 gloo ranks (every parameter data-parallel)."""
    from megatron_bitdet.fingerprint.shards import CHECK_CHUNKS, ROW_BYTES

    per = {}
    for dp in (1, 2, 4):
        assert run(tmp_path / f"dp{dp}", "parallel.expert=1", "training.lr_schedule.warmup_iters=0", nproc=dp,
                   iterations=1) == 0
        per[dp] = [rank_bytes(lines(tmp_path / f"dp{dp}", r)[0]) for r in range(dp)]
    total = per[1][0]["params"][0]
    assert per[1][0]["params"][1] == 0 and per[1][0]["grads"] == (total, 0)  # one replica: all of it, no check
    for dp in (2, 4):
        for r, got in enumerate(per[dp]):
            own, checked = got["params"]
            # a slice of whole rows: total/dp within a row; the check a quarter of a slice, within a row
            # (step 1 checks chunk 1 of rank 0's slice: rank 0 digests it as its own)
            assert abs(own - total / dp) <= ROW_BYTES
            assert abs(checked - (0 if r == 0 else total / dp / CHECK_CHUNKS)) <= ROW_BYTES
            assert got["grads"] == (total // dp, 0)  # megatron's shard of the (padded) buffer, exactly
        assert sum(got["params"][0] for got in per[dp]) == total  # the slices tile the buffer once
        assert max(sum(got["params"]) for got in per[dp]) <= max(sum(got["params"]) for got in per[dp // 2]) / 2 \
            * (1 + (1 / CHECK_CHUNKS if dp == 2 else 0)) + 2 * ROW_BYTES


@pytest.mark.timeout(600)
@pytest.mark.parametrize("overrides,kinds", [
    (["parallel.expert=1", "--provider"], {"params", "grads", "buffers", "generators"}),
    (["recipe=bf16", "parallel.distributed_optimizer=false"],
     {"params", "grads", "main_params", "exp_avg", "exp_avg_sq", "buffers"}),
    (["recipe=fp8"], {"params", "grads", "main_params", "buffers", "fp8_values", "fp8_scales"}),
], ids=["fp32_distopt_generators", "bf16_replicated", "fp8_distopt"])
def test_a_flipped_bit_in_every_buffer_kind_on_every_rank_changes_the_line(tmp_path, test_workers, overrides, kinds):
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.train.run import RunOptions, launch_training

    recipe_file = {"recipe=bf16": "nemotron_h_tiny_bf16.yaml", "recipe=fp8": "nemotron_h_tiny_fp8.yaml"}
    name = next((recipe_file[o] for o in overrides if o in recipe_file), RECIPE.name)
    rest = [o for o in overrides if o not in recipe_file and o != "--provider"]
    recipe = load_recipe(str(REPO / "recipes" / name), ["training.iterations=3", *rest])
    provider = "generator_provider:provider" if "--provider" in overrides else None
    out = tmp_path / "out"
    out.mkdir()
    rc = launch_training(recipe, RunOptions(nproc=2, run_dir=tmp_path / "run", model_provider=provider),
                         worker="fingerprint_workers:flip_every_kind", worker_args={"out": str(out)})
    assert rc == 0
    for rank in (0, 1):
        changed = json.loads((out / f"rank_{rank}.json").read_text())
        assert set(changed) == kinds, rank
        assert all(all(v) for v in changed.values()), (rank, changed)
