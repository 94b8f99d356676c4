"""Issue 40 item 4 on real gloo training: a DP = 4 run's checkpoint resumed at DP = 2 and a DP = 4 run's
step replayed on one rank, bit for bit, under ``determinism.reductions: dp_invariant``; without the mode
both are refused for scope before any launch. One DP = 4 run (checkpoint and live-state snapshot at step 2)
is verify-resume's reference and the replayed run.
"""
import json
import shutil
from pathlib import Path

import pytest

from megatron_bitdet.cli import main
from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.rundir import checkpoints_dir, fingerprints_dir, iter_dir
from megatron_bitdet.train.checkpoint import layout, read_meta
from megatron_bitdet.train.run import RunOptions, launch_training
from megatron_bitdet.workflows.resume import DP_SHARDED_NOTE, rank_map, recipe_segment, run_chain

ROOT = Path(__file__).resolve().parents[1]
RECIPE = str(ROOT / "recipes" / "nemotron_h_tiny.yaml")
# EP 1 so that one rank can host the model; the global batch (8) covers 4 virtual ranks x micro-batch 2
LAYOUT = ["training.iterations=3", "training.lr_schedule.warmup_iters=1", "parallel.expert=1"]
MODE = ["determinism.reductions=dp_invariant", "determinism.virtual_dp=4"]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def recipe():
    return load_recipe(RECIPE, LAYOUT + MODE)


@pytest.fixture(scope="module")
def dp4_run(recipe, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("dp") / "dp4"
    rc = launch_training(recipe, RunOptions(nproc=4, run_dir=run_dir, fresh=True, save_interval=2, snapshot_at=[2]))
    assert rc == 0
    return run_dir


@pytest.fixture(scope="module")
def resumed_at_dp2(dp4_run, tmp_path_factory) -> tuple[int, Path]:
    """verify-resume --resume-nproc 2 against the DP = 4 run: (exit code, --out)."""
    out = tmp_path_factory.mktemp("vr") / "out"
    rc = main(["verify-resume", "--recipe", RECIPE, "--nproc", "4", "--resume-nproc", "2", "--resume-at", "2",
               "--reference", str(dp4_run), "--out", str(out), "--json", *LAYOUT, *MODE])
    return rc, out


def test_dp4_checkpoint_resumed_at_dp2_matches_the_uninterrupted_run(resumed_at_dp2, recipe):
    rc, out = resumed_at_dp2
    report = json.loads((out / "verify_resume.json").read_text())
    assert rc == 0, report
    assert report["holds"] and report["resume_nproc"] == 2 and report["not_compared"] == [DP_SHARDED_NOTE]
    fresh, resumed = report["points"]
    assert [fresh["steps_compared"], resumed["steps_compared"]] == [[1, 2], [3]]
    # the checkpoint crossed DP: saved by 4 ranks, restored and continued by 2
    saved = read_meta(iter_dir(checkpoints_dir(Path(fresh["run_dir"])), 2))
    assert saved["world_size"] == 4 and saved["ranks"] == layout(recipe.parallel, 4)
    assert sorted(p.name for p in fingerprints_dir(Path(resumed["run_dir"])).iterdir()) == \
        ["rank_00000.jsonl", "rank_00001.jsonl"]
    # every resumed rank's live state was compared, leaf by leaf, except the DP-sharded optimizer leaves
    checks = [c for c in report["checks"] if c["resume_step"] == 2]
    assert {c["rank"] for c in checks} == {0, 1}
    components = {c["component"] for c in checks}
    assert {"parameters", "optimizer", "scheduler", "data", "rng.torch_cpu", "rng.tracker"} <= components
    assert not [c for c in checks if c["component"] == "optimizer" and ".param" in c["key"]]
    # ... which are compared whole: 4 ranks' logical partials added against 2 ranks'
    logical = {c["key"].split()[0]: c["equal"] for c in checks if c["component"] == "logical"}
    assert logical == {"params": True, "exp_avg": True, "exp_avg_sq": True}, logical


@pytest.mark.slow
def test_a_skipped_optimizer_restore_across_dp_is_named_at_the_restore(recipe, dp4_run, resumed_at_dp2, tmp_path):
    """The optimizer shards are not compared leaf by leaf across DP: a restore that skips exp_avg is named
    at the restore by the logical digests (every rank's partial added) and shows in the next step's
    outputs. Continues from the correct chain's fresh segment (one launch, at DP 2)."""
    fresh = resumed_at_dp2[1] / "segment_00_0000000-0000002"
    launch = recipe_segment(recipe, nproc=4, resume_nproc=2, faults=["optimizer.exp_avg"])

    def segment(run_dir: Path, start: int, stop: int, load_from, full=None) -> None:
        if start or full is not None:
            launch(run_dir, start, stop, load_from, full=full)
        else:
            shutil.copytree(fresh, run_dir)

    report = run_chain(segment, name=recipe.name, steps=[2], iterations=3, nproc=2, out_dir=tmp_path,
                       reference_dir=dp4_run, faults=["optimizer.exp_avg"], reference_ranks=rank_map(recipe, 4, 2))
    resumed = report.points[1]
    assert not report.holds and resumed.failing_components == ["logical"], report.summary()
    assert [c.key for c in report.failures] == ["exp_avg (every rank's partial added)"], report.summary()
    assert resumed.first_output_divergence == 3 and "digest:logical_params" in resumed.divergent_metrics
    assert "resume at 2: logical differs (rank 0, exp_avg (every rank's partial added)" in report.summary()


def test_replay_of_a_dp4_step_on_one_rank_reproduces_it(dp4_run, tmp_path, capsys):
    out = tmp_path / "replay"
    rc = main(["replay", str(dp4_run), "--step", "3", "--context", "0", "--nproc", "1", "--out", str(out), "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0, result
    assert (result["verdict"], result["checkpoint"], result["verified"]) == ("reproduced", 2, [3])
    assert sorted(p.name for p in fingerprints_dir(out).iterdir()) == ["rank_00000.jsonl"]


@pytest.mark.parametrize("argv, says", [
    (["verify-resume", "--recipe", RECIPE, "--nproc", "4", "--resume-nproc", "2", "--resume-at", "2", *LAYOUT],
     "--resume-nproc 2 (the run has 4 ranks): the recipe runs determinism.reductions=native"),
    (["verify-resume", "--recipe", RECIPE, "--nproc", "4", "--resume-nproc", "3", "--resume-at", "2", *LAYOUT, *MODE],
     "determinism.virtual_dp=4 is not divisible by the data-parallel size 3"),
    (["verify-resume", "--recipe", RECIPE, "--resume-nproc", "0", "--resume-at", "2", *LAYOUT, *MODE],
     "--resume-nproc 0: must be a positive number of ranks"),
])
def test_a_resume_at_another_dp_without_the_mode_is_refused_for_scope(argv, says, tmp_path, capsys):
    """The negative control: without dp_invariant a run's bits follow its DP size, so no verdict (exit 2)."""
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before any launch


def test_a_replay_on_a_dp_that_cannot_host_the_run_is_refused(dp4_run, tmp_path, capsys):
    assert main(["replay", str(dp4_run), "--step", "3", "--nproc", "3", "--out", str(tmp_path / "r")]) == 2
    assert "determinism.virtual_dp=4 is not divisible by the data-parallel size 3" in capsys.readouterr().err
