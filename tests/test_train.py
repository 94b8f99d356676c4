"""`bitdet train` end to end: real 2-rank gloo runs of the hybrid M*EM-E model, fingerprint bytes compared."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from conftest import ITERATIONS, REPO, RECIPE, RESUME_AT, Run, train
from megatron_bitdet.cli import main as bitdet
from megatron_bitdet.fingerprint import decode_float

STEPS = list(range(1, ITERATIONS + 1))
PROVIDER = "examples.wider_mlp_provider:provider"

# name -> (overrides, expected scope entries, ranks that hold the loss)
LAYOUTS = {
    # megatron refuses MoE with TP but without SP, so plain TP2 runs the hybrid's dense variant
    "tp2": (["parallel.tensor=2", "parallel.expert=1", "model.hybrid_pattern=M*-M--"],
            {"tp": 2, "dp": 1, "ep": 1, "sp": False}, (0, 1)),
    "tp2_sp": (["parallel.tensor=2", "parallel.expert=1", "parallel.sequence_parallel=true"],
               {"tp": 2, "dp": 1, "sp": True}, (0, 1)),
    # the first stage (M*-) has no MoE layer: its aux-loss tracker entry must still join the PP sum
    "pp2": (["parallel.pipeline=2", "parallel.expert=1", "model.hybrid_pattern=M*-M*E"],
            {"pp": 2, "tp": 1, "dp": 1}, (1,)),
    "dp2_distopt": (["parallel.expert=1"], {"dp": 2, "tp": 1, "pp": 1, "ep": 1}, (0, 1)),
}


def assert_trained(run: Run, scope: dict, loss_ranks) -> None:
    """Exit 0, a line per step per rank, finite losses where the loss lives, the layout in the scope."""
    assert run.rc == 0
    for rank in (0, 1):
        lines = run.steps(rank)
        assert [line["step"] for line in lines] == STEPS
        assert {line["rank"] for line in lines} == {rank}
        for line in lines:
            assert set(line["digests"]) == {"params", "grads", "buffers"}
            if rank in loss_ranks:
                assert math.isfinite(decode_float(line["metrics"]["loss"]))
            else:  # off the last pipeline stage there is no loss to report
                assert "loss" not in line["metrics"]
    manifest = run.manifest()
    assert {k: manifest["scope"][k] for k in scope} == scope
    assert manifest["scope"]["world_size"] == 2


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layout_trains_and_twins_are_byte_identical(layout, tmp_path):
    overrides, scope, loss_ranks = LAYOUTS[layout]
    run = train(tmp_path / "a", *overrides)
    assert_trained(run, scope, loss_ranks)
    twin = train(tmp_path / "b", *overrides)
    assert twin.rc == 0
    for rank in (0, 1):
        assert twin.fingerprint_bytes(rank) == run.fingerprint_bytes(rank), f"{layout}: rank {rank} differs"
    if layout == "dp2_distopt":
        assert run.manifest()["recipe"]["parallel"]["distributed_optimizer"] is True
    if layout == "pp2":  # the stage without experts reports the PP-summed aux loss too (on 0.18+ it hung)
        for a, b in zip(run.steps(0), run.steps(1), strict=True):
            aux = {k: v for k, v in a["metrics"].items() if k.startswith("aux_loss/")}
            assert list(aux) == ["aux_loss/seq_load_balancing_loss/layer_06"]
            assert aux == {k: b["metrics"][k] for k in aux}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides, message", [
    (["parallel.tensor=2", "parallel.expert=1"], "sequence_parallel"),  # megatron's MoE refuses TP without SP
    (["training.iterations=2"], "warmup_iters"),  # megatron's scheduler asserts warmup < decay steps
])
def test_recipe_megatron_rejects_is_refused_before_launch(overrides, message, tmp_path, capsys):
    """A recipe megatron would reject mid-run is bad input: exit 2 with the key named, no rank started."""
    assert bitdet(["train", "--recipe", str(RECIPE), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                   *overrides]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "logs").exists()


def test_a_run_dir_under_a_file_is_refused_naming_it(tmp_path, capsys):
    """``--run-dir`` whose parent is a file: exit 2 naming both, not a NotADirectoryError traceback."""
    (tmp_path / "file").write_text("")
    assert bitdet(["train", "--recipe", str(RECIPE), "--nproc", "2", "--run-dir", str(tmp_path / "file" / "run")]) == 2
    assert f"{tmp_path / 'file' / 'run'}: cannot create the run directory: {tmp_path / 'file'} is a file" in \
        capsys.readouterr().err


def test_default_layout_ep2_alltoall_trains(reference_run):
    assert_trained(reference_run, {"ep": 2, "dp": 2, "tp": 1, "pp": 1}, (0, 1))
    assert reference_run.manifest()["recipe"]["model"]["moe"]["dispatcher"] == "alltoall"


def test_aux_loss_is_reduced_across_ranks(reference_run):
    """The load-balancing losses go through megatron's tracker reduction (PP sum, DP average), whose
    float sums the moe_aux_loss swap makes rank-ordered: every rank logs the same bits of the
    DP-averaged loss, not its own share of the data's."""
    assert reference_run.rc == 0
    for a, b in zip(reference_run.steps(0), reference_run.steps(1), strict=True):
        aux = {k: v for k, v in a["metrics"].items() if k.startswith("aux_loss")}
        assert len(aux) == 3 and aux == {k: b["metrics"][k] for k in aux}  # total + the two MoE layers
        assert a["metrics"]["loss"] == b["metrics"]["loss"]


@pytest.fixture(scope="module")
def twin_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("twin"), save_interval=1, snapshot_at=[RESUME_AT])


@pytest.fixture(scope="module")
def other_seed_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("seed"), "training.seed=4321")


@pytest.fixture(scope="module")
def one_thread_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("threads1"), "determinism.threads=1")


@pytest.mark.timeout(120)
def test_identical_runs_are_byte_identical(reference_run, twin_run):
    assert twin_run.rc == 0
    for rank in (0, 1):
        assert twin_run.fingerprint_bytes(rank) == reference_run.fingerprint_bytes(rank)


@pytest.mark.timeout(120)
def test_other_seed_gives_other_bytes(reference_run, other_seed_run):
    """The identity above is not vacuous: a real change in the run changes every rank's file."""
    assert other_seed_run.rc == 0
    for rank in (0, 1):
        ref, other = reference_run.steps(rank), other_seed_run.steps(rank)
        assert ref[0]["digests"]["params"] != other[0]["digests"]["params"]
        assert ref[0]["metrics"]["loss"] != other[0]["metrics"]["loss"]


@pytest.mark.timeout(120)
def test_resume_continues_bit_for_bit(reference_run, resumed_run):
    assert resumed_run.rc == 0
    for rank in (0, 1):
        assert resumed_run.fingerprint_lines(rank) == reference_run.fingerprint_lines(rank)[RESUME_AT:]
        steps = resumed_run.steps(rank)
        assert [s["step"] for s in steps] == list(range(RESUME_AT + 1, ITERATIONS + 1)) and len(steps) >= 2
        assert all(decode_float(s["metrics"]["lr"]) > 0 for s in steps)  # trained steps, not lr-0 warmup


@pytest.mark.timeout(120)
def test_thread_count_is_in_scope_and_compare_refuses(reference_run, one_thread_run, capsys, machine_outcome):
    """Whether 1 and 2 threads give different bits is the CPU's to decide; forced, compare must say which."""
    assert one_thread_run.rc == 0
    a, b = reference_run.manifest()["scope"], one_thread_run.manifest()["scope"]
    assert (a["torch_threads"], b["torch_threads"]) == (2, 1)
    assert bitdet(["compare", str(reference_run.dir), str(one_thread_run.dir)]) == 2
    err = capsys.readouterr().err
    assert "torch_threads" in err
    same = all(reference_run.fingerprint_bytes(r) == one_thread_run.fingerprint_bytes(r) for r in (0, 1))
    machine_outcome(f"1 vs 2 threads: bits {'identical' if same else 'differ'} over {ITERATIONS} steps")
    assert bitdet(["compare", "--force", str(reference_run.dir), str(one_thread_run.dir)]) == (0 if same else 1)


BAD_PROVIDERS = {
    "examples.wider_mlp_provider": "expected MODULE:FUNC",
    "no_such_module_bitdet:provider": "cannot import module 'no_such_module_bitdet'",
    "examples.wider_mlp_provider:no_such_provider": "has no attribute 'no_such_provider'",
    "json:dumps": "must accept (recipe, config, *, pre_process, post_process)",  # a real wrong signature
}


def _train_args(run_dir, spec):
    return ["train", "--recipe", str(RECIPE), "--nproc", "2", "--run-dir", str(run_dir), "--model-provider", spec]


@pytest.mark.parametrize("spec", list(BAD_PROVIDERS))
def test_bad_model_provider_is_refused_before_launch(spec, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the working directory on sys.path
    assert bitdet(_train_args(tmp_path / "run", spec)) == 2
    assert BAD_PROVIDERS[spec] in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # no rank was started, nothing was written


@pytest.mark.timeout(60)
def test_bad_model_provider_exits_2_without_traceback(tmp_path):
    """The same refusal as a real process: exit status 2, one clear line, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "megatron_bitdet", *_train_args(tmp_path / "run", "json:dumps")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "bitdet train: error: --model-provider 'json:dumps'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def provider_run(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the ranks import the example from the repository root
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        return train(tmp_path_factory.mktemp("provider"), model_provider=PROVIDER)


@pytest.mark.timeout(120)
def test_custom_provider_trains_and_is_recorded(reference_run, provider_run):
    assert_trained(provider_run, {"ep": 2, "dp": 2}, (0, 1))
    assert provider_run.manifest()["model_provider"] == PROVIDER
    for rank in (0, 1):  # a different model: its parameters differ from the default's at step 1
        assert provider_run.steps(rank)[0]["digests"]["params"] != reference_run.steps(rank)[0]["digests"]["params"]


@pytest.mark.timeout(120)
def test_provider_and_torch_flags_are_in_the_scope(reference_run, provider_run, capsys):
    """A custom-provider run is another validation scope, not a divergence; torch's live determinism
    flags (after the provider ran) are recorded."""
    scope = reference_run.manifest()["scope"]
    assert scope["model_provider"] == "default" and scope["torch/deterministic_algorithms"] is True
    assert scope["torch/cudnn_benchmark"] is False and scope["torch/fill_uninitialized_memory"] is False
    assert provider_run.manifest()["scope"]["model_provider"] == PROVIDER
    capsys.readouterr()
    assert bitdet(["compare", str(reference_run.dir), str(provider_run.dir)]) == 2
    assert "model_provider" in capsys.readouterr().err
