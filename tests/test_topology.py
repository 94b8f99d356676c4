"""Topology-invariant reductions (issue 15), in real 4-rank training runs.

gloo picks one algorithm, so another allocation's physical ring is emulated: ``BITDET_EMULATED_RING``
routes every float reduction over point-to-point hops along a ring order drawn from the seed. The
ordinary (travel-order) reduction's bits must change with that order; the invariant reduction's must
not, and must equal the same run on two "nodes" (network namespaces, torchrun, c10d rendezvous).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import RECIPE
from megatron_bitdet.cli import main as bitdet
from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.train.run import RunOptions, launch_training
from megatron_bitdet.workflows.tax import NATIVE_REDUCTIONS, measure_tax

# 4 ranks on 2 cores: one thread each; warm-up off so 2 steps both train at full lr.
OVERRIDES = ["training.iterations=2", "training.lr_schedule.warmup_iters=0", "determinism.threads=1"]


def _train(run_dir: Path, reductions: str, ring: str | None) -> Path:
    """One 4-rank run launched from this process (what `bitdet train --nproc 4` does, without another
    interpreter start): the ranks get this environment with the ring set or removed."""
    recipe = load_recipe(str(RECIPE), [*OVERRIDES, f"determinism.reductions={reductions}"])
    with pytest.MonkeyPatch.context() as mp:
        # OMP_NUM_THREADS is in the validation scope; torchrun sets it to 1, so the one-node runs do too.
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.delenv("BITDET_EMULATED_RING", raising=False)
        if ring is not None:
            mp.setenv("BITDET_EMULATED_RING", ring)
        assert launch_training(recipe, RunOptions(nproc=4, run_dir=run_dir)) == 0, run_dir / "logs"
    return run_dir


def _fingerprints(run_dir: Path) -> list[bytes]:
    files = sorted((run_dir / "fingerprints").glob("rank_*.jsonl"))
    assert len(files) == 4
    return [f.read_bytes() for f in files]


def _compare(a: Path, b: Path, capsys) -> tuple[int, str]:
    """`bitdet compare A B` (in-process): exit code and everything it printed."""
    capsys.readouterr()
    rc = bitdet(["compare", str(a), str(b)])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("topology")
    return {name: _train(root / name, reductions, ring) for name, reductions, ring in (
        ("native_ring1", "native", "1"), ("native_ring2", "native", "2"),
        ("invariant_ring1", "topology_invariant", "1"), ("invariant_ring2", "topology_invariant", "2"),
    )}


def test_ordinary_reduction_bits_follow_the_ring(ring_runs, capsys):
    a, b = _fingerprints(ring_runs["native_ring1"]), _fingerprints(ring_runs["native_ring2"])
    assert all(x != y for x, y in zip(a, b)), "travel-order sums gave the same bits on two rings"
    # Same recipe, another ring: with native reductions placement is in the scope, so it is refused.
    rc, out = _compare(ring_runs["native_ring1"], ring_runs["native_ring2"], capsys)
    assert rc == 2 and "placement" in out, out


def test_invariant_reduction_bits_ignore_the_ring(ring_runs, capsys):
    a, b = _fingerprints(ring_runs["invariant_ring1"]), _fingerprints(ring_runs["invariant_ring2"])
    assert a == b
    rc, out = _compare(ring_runs["invariant_ring1"], ring_runs["invariant_ring2"], capsys)
    assert rc == 0, out
    manifest = json.loads((ring_runs["invariant_ring1"] / "manifest.json").read_text())
    assert "placement" not in manifest["scope"]
    record = next(p for p in manifest["patches"] if p["id"] == "topology_invariant_reductions")
    assert record["transport"] == "RingTransport" and record["emulated_ring_seed"] == "1"
    # What the manifest says is swapped is what megatron calls: the DDP bucket reduce-scatter alias,
    # the TP mappings' alias and torch.distributed.all_reduce (loss, grad norm, DDP all-reduce).
    for binding in ("megatron.core.distributed.param_and_grad_buffer:dist_reduce_scatter_func",
                    "megatron.core.tensor_parallel.mappings:dist_reduce_scatter_func",
                    "torch.distributed:all_reduce"):
        assert binding in record["bindings"]


def test_two_nodes_through_torchrun_equal_one_node(ring_runs, two_nodes, tmp_path, capsys):
    run_dir = tmp_path / "two_nodes"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {k: v for k, v in os.environ.items() if k != "BITDET_EMULATED_RING"}
    procs = []
    for i in (0, 1):
        cmd = [*two_nodes.prefix(i), torchrun, "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{two_nodes.master}:29477", "--rdzv-id", "bitdet-topology",
               "-m", "megatron_bitdet", "train", "--recipe", str(RECIPE), "--run-dir", str(run_dir),
               *OVERRIDES, "determinism.reductions=topology_invariant"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    # No emulated ring here, two hosts, c10d's own transport: the same bits as the 1-node ring runs.
    assert _fingerprints(run_dir) == _fingerprints(ring_runs["invariant_ring1"])
    manifest = json.loads((run_dir / "manifest.json").read_text())
    ranks = manifest["placement"]["ranks"]
    assert len(ranks) == 4 and sorted(r["local_rank"] for r in ranks) == [0, 0, 1, 1] and all(r["host"] for r in ranks)
    rc, out = _compare(ring_runs["invariant_ring1"], run_dir, capsys)
    assert rc == 0, out


def test_tax_reports_the_invariant_reductions_cost(tmp_path):
    """The deterministic recipe with invariant reductions is stepped beside the same recipe with c10d's,
    interleaved in one launch; the baseline stays the fastest nondeterministic candidate."""
    recipe = load_recipe(str(RECIPE), ["determinism.reductions=topology_invariant"])
    tax = measure_tax(recipe, nproc=2, rounds=2, warmup=0, profile_steps=1, out_dir=tmp_path)
    native = next(s for s in tax.candidates if s.name == NATIVE_REDUCTIONS)
    assert not tax.baseline.deterministic and tax.baseline is not native
    # Recorded inside each side's steps on every rank: the swap is on for one side and off for the other.
    assert tax.deterministic.invariant_reductions == [True]
    assert native.invariant_reductions == [False] and tax.baseline.invariant_reductions == [False]
    paired = [a / b - 1 for a, b in zip(tax.deterministic.step_ms, native.step_ms)]
    assert tax.reductions_percent == float(np.median(paired)) * 100
    assert "topology-invariant reductions" in tax.summary()
