"""The automatic ladder on real 2-rank training: two runs of the planted example (an order-varying
atomic sum drawn from os.urandom on rank 0) with fingerprints only -> re-runs traced at module, then
op level -> the planted op, its module, the step and the rank; rank 1 a receiver -> the kernel rung:
the op's inputs captured in both re-runs and replayed in a fresh process (varies on one thread and
with deterministic algorithms: an order inside the kernel)."""
import json
import os
from pathlib import Path

import pytest

from megatron_bitdet.workflows.ladder import LadderConfig, run_ladder
from megatron_bitdet.cli import main
from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.train.run import RunOptions, launch_training

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "nemotron_h_tiny.yaml"
PLANTED = "examples.planted_nondeterminism:provider"


@pytest.fixture(scope="module")
def planted_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("planted")
    recipe = load_recipe(RECIPE, ["training.iterations=3"])
    cwd = os.getcwd()
    os.chdir(ROOT)  # the ranks (and the ladder) import the example provider from the repository root
    try:
        for name in ("a", "b"):
            assert launch_training(recipe, RunOptions(nproc=2, run_dir=base / name, model_provider=PLANTED,
                                                      stop_at=1)) == 0
        yield base / "a", base / "b"
    finally:
        os.chdir(cwd)


@pytest.fixture(scope="module")
def ladder(planted_runs):
    return run_ladder(*planted_runs, LadderConfig(levels=("module", "op")))


@pytest.mark.timeout(900)
def test_fingerprint_only_runs_have_no_tracing(planted_runs):
    for run in planted_runs:
        assert not (run / "traces").exists()
        assert json.loads((run / "manifest.json").read_text())["trace"] is None


@pytest.mark.timeout(900)
def test_ladder_names_the_planted_op_module_step_and_rank(ladder):
    assert ladder.diverged and ladder.reproduced and ladder.exit_code == 1
    assert ladder.first_step == 1
    assert [r.level for r in ladder.rungs] == ["module", "op"]
    module, op = ladder.rungs
    assert module.steps == [1, 1] and op.steps == [1, 1]
    assert module.culprit["module"] == "decoder.layers.4.mlp.linear_fc2" and module.culprit["op"] == "forward"
    c = ladder.culprit
    assert (c["op"], c["module"], c["step"], c["rank"], c["phase"], c["classification"]) == (
        "bitdet_example.atomic_sum.default", "decoder.layers.4.mlp.linear_fc2", 1, 0, "forward", "producer")
    assert c["receivers"] == [1]  # rank 1 has no plant: the difference reached it through a collective
    for run in op.run_dirs:
        assert (Path(run) / "traces" / "rank_00000.trace.jsonl").is_file()


@pytest.mark.timeout(900)
def test_kernel_rung_names_the_op_its_thread_independence_and_the_alternative(ladder, planted_runs):
    k = ladder.kernel
    assert k["status"] == "replayed", k
    assert k["op"] == "bitdet_example.atomic_sum.default" and k["rank"] == 0
    assert k["event_id"] == ladder.culprit["event_id"]
    by = {c["label"]: c for c in k["configs"]}
    one = by["1 thread"]
    det = next(c for label, c in by.items() if label.startswith("deterministic"))
    assert one["repeats"] == det["repeats"] == 20 and one["distinct"] > 1 and det["distinct"] > 1
    assert k["mechanism"] == "order_inside_kernel" and k["deterministic_variant"] == "no"
    assert "varies on one thread too" in k["verdict"] and "fixed-order implementation" in k["verdict"]
    assert "captured inputs identical in both runs" in k["evidence"]
    for run in planted_runs:
        assert (run / "ladder" / "kernel" / "captures" / "rank_00000.capture.pt").is_file()
    saved = json.loads((planted_runs[0] / "ladder" / "result.json").read_text())
    assert saved["kernel"]["verdict"] == k["verdict"]
    from megatron_bitdet.analysis.diagnose import diagnose, facts_from_ladder

    assert diagnose(facts_from_ladder(saved)).top.id == "atomic_order_accumulation"


@pytest.mark.timeout(900)
def test_cli_on_the_ladder_outputs_compares_traces_directly(ladder, capsys):
    a, b = ladder.rungs[-1].run_dirs
    assert main(["localize", a, b, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["culprit"]["op"] == "bitdet_example.atomic_sum.default" and out["culprit"]["rank"] == 0


def test_ladder_refuses_a_scope_mismatch(planted_runs, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    manifest = json.loads((planted_runs[1] / "manifest.json").read_text())
    manifest["scope"]["torch_threads"] = 99
    (other / "manifest.json").write_text(json.dumps(manifest))
    (other / "fingerprints").mkdir()
    for f in (planted_runs[1] / "fingerprints").iterdir():
        (other / "fingerprints" / f.name).write_bytes(f.read_bytes())
    assert main(["localize", str(planted_runs[0]), str(other)]) == 2
    assert "validation scopes differ" in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_a_rerun_whose_traces_are_cut_short_is_incomplete_not_intermittent(planted_runs, monkeypatch):
    """Re-run traces that end in a cut record before any mismatch compared nothing after the cut: the
    ladder says so, and never that the divergence did not reproduce (the fault, a cut trace, is the
    subject: the real re-runs' traces are cut after they finish)."""
    from megatron_bitdet.rundir import trace_dir
    from megatron_bitdet.workflows import ladder as ladder_mod

    real = ladder_mod._relaunch_both

    def relaunch_then_cut(*args, **kwargs):
        outs = real(*args, **kwargs)
        for path in trace_dir(outs[1]).iterdir():
            header, first = path.read_bytes().split(b"\n")[:2]
            path.write_bytes(header + b"\n" + first[: len(first) // 2])
        return outs

    monkeypatch.setattr(ladder_mod, "_relaunch_both", relaunch_then_cut)
    result = run_ladder(*planted_runs, LadderConfig(levels=("semantic",), retries=0, kernel=False))
    assert result.diverged and result.reproduced is False and result.culprit is None
    assert result.note.startswith("incomplete: the semantic re-run's traces (steps 1-1) were not compared to their "
                                  "end (rank 0: "), result.note
    assert "neither reproduced nor ruled out" in result.note and "intermittent" not in result.note
