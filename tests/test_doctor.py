"""`bitdet doctor` names the right catalog entry on real 2-rank training for: a divergence from step 1
caused by a run-time choice (a provider whose linears pick a split-K kernel by timing the candidates),
a fused-aux-loss-style MoE-only divergence (per-expert sums accumulated in an os.urandom order), and a
thread-count scope change. (An RNG not restored after resume: test_verify_resume, on its fault runs.)"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_bitdet.cli import main

from conftest import train

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/nemotron_h_tiny.yaml"
pytestmark = pytest.mark.timeout(900)


def _pair(base: Path, provider: str, *overrides: str) -> tuple[str, str]:
    def one(name):
        return main(["train", "--recipe", RECIPE, "--nproc", "2", "--run-dir", str(base / name),
                     "--model-provider", provider, *overrides])
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(one, "ab")) == [0, 0]
    return str(base / "a"), str(base / "b")


def _causes(out: str) -> list[str]:
    return [line.split("]")[0].split("[")[1] for line in out.splitlines() if line[:1].isdigit() and ". [" in line]


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # ranks and the ladder import the example providers from the repository root


def test_runtime_kernel_choice_from_step_1(tmp_path, at_root, capsys):
    a, b = _pair(tmp_path, "examples.planted_nondeterminism:autotune_provider", "--stop-at", "1",
                 "training.iterations=3")
    assert main(["doctor", a, b, "--levels", "op"]) == 1
    out = capsys.readouterr().out
    assert "verdict: diverged at step 1" in out
    assert _causes(out)[0] == "runtime_autotuning", out
    assert "localize culprit: control_divergence" in out and "kernel rung: runtime_configuration" in out


def test_fused_aux_loss_style_moe_only_divergence(tmp_path, at_root, capsys):
    # The planted sums differ run to run in their last bits, but in this tiny model a one-ulp difference
    # is often absorbed by the loss's later arithmetic: over 8 runs (28 pairs) the 3 aux values of a step
    # coincided in 25-100% of pairs each, so 3 steps (9 values) all coincided about once in 50 pairs
    # (seen once in CI). 8 steps (24 values) make a false "match" a few-in-10^5 event (that rate per step,
    # to the 8th power).
    a, b = _pair(tmp_path, "examples.planted_nondeterminism:fused_aux_loss_provider", "training.iterations=8")
    assert main(["doctor", a, b, "--offline"]) == 1
    out = capsys.readouterr().out
    assert _causes(out)[0] == "moe_fused_aux_loss", out
    assert "lm_loss bit-identical at the first divergent step" in out and "differing first: aux_loss" in out
    # the catalog's fixes (determinism.swaps=true, model.moe.router_fusion=false) are what these runs had:
    # the planted sums are the provider's own code
    assert "determinism.swaps=true is already set in both runs" in out
    assert ("next: bitdet fixcheck --recipe RECIPE --model-provider "
            "examples.planted_nondeterminism:fused_aux_loss_provider --fix-provider MODULE:FIXED_PROVIDER") in out


def test_thread_count_scope_change(reference_run, tmp_path, capsys):
    one_thread = train(tmp_path / "t1", "determinism.threads=1", stop_at=1)
    assert one_thread.rc == 0
    assert main(["doctor", str(reference_run.dir), str(one_thread.dir)]) == 1
    out = capsys.readouterr().out
    assert "verdict: scope mismatch" in out
    assert _causes(out)[0] == "thread_count_scope", out
    assert "torch_threads" in out and "recipe/determinism.threads" in out


def test_doctor_bad_input_exits_2(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert "no verify_resume.json" in capsys.readouterr().err
    (tmp_path / "verify_resume.json").write_bytes(b"\xff{not json")
    assert main(["doctor", str(tmp_path)]) == 2
    assert "verify_resume.json" in capsys.readouterr().err
    assert main(["doctor", str(tmp_path / "a"), str(tmp_path / "b")]) == 2


POINT = {"step": 2, "stop": 4, "state_holds": True, "failing_components": [], "first_output_divergence": None,
         "steps_compared": [3, 4]}


@pytest.mark.parametrize("report, message", [
    ({"points": [POINT], "holds": "false"}, "'holds' is 'false', not true or false"),
    ({"points": [POINT], "holds": float("nan")}, "'holds' is nan"),
    ({"points": [], "holds": True}, "points is not a non-empty list"),
    ({"points": [1], "holds": False}, "points is not a non-empty list of objects"),
    ({"points": [{**POINT, "failing_components": 5}], "holds": False}, "points[0] is not a resume point"),
    ({"points": [{**POINT, "step": "a"}], "holds": False}, "points[0] is not a resume point"),
    ({"points": [{**POINT, "first_output_divergence": 3}], "holds": True}, "the report contradicts itself"),
    ({"points": [{**POINT, "step": 0}], "holds": True}, "no point resumed from a checkpoint"),
])
def test_doctor_refuses_a_verify_resume_report_that_does_not_say_what_held(tmp_path, capsys, report, message):
    """A report whose verdict is not a boolean, or contradicts its points, never reads 'resume holds'."""
    import json

    (tmp_path / "verify_resume.json").write_text(json.dumps(report))
    assert main(["doctor", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "verify_resume.json" in captured.err and "holds" not in captured.out
    (tmp_path / "verify_resume.json").write_text(json.dumps({"points": [POINT], "holds": True}))
    assert main(["doctor", str(tmp_path)]) == 0 and "verdict: resume holds" in capsys.readouterr().out


def test_doctor_on_an_incomplete_pair_says_so(tmp_path, capsys):
    """Run B stopped after step 3 of 5: the common steps match, which is not a match (nor a divergence)."""
    from test_compare import write_run

    a, b = write_run(tmp_path / "a", steps=5), write_run(tmp_path / "b", steps=3)
    assert main(["doctor", str(a), str(b), "--offline"]) == 1
    out = capsys.readouterr().out
    assert "verdict: incomplete" in out and "only in A: 4-5; only in B: none" in out and "Traceback" not in out


@pytest.mark.parametrize("change, message", [
    ({"culprit": "x"}, "culprit is not an object of strings"),
    ({"kernel": [1]}, "kernel is not an object of strings"),
    ({"first_metrics": 5}, "first_step / first_metrics of the wrong type"),
    ({"run_b": "a\u0000b"}, "run_b is not a path"),
    ({"diverged": "yes"}, "diverged is not true or false"),
])
def test_doctor_refuses_a_saved_ladder_of_the_wrong_shape(tmp_path, capsys, change, message):
    import json

    from test_compare import write_run

    a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b", nudge=(0, 2))
    saved = {"run_a": str(a), "run_b": str(b), "diverged": True, "first_step": 2, "first_metrics": ["loss"],
             "culprit": {"classification": "producer", "op": "aten.mm.default", "module": "m", "evidence": "e"},
             "kernel": None}
    (a / "ladder").mkdir()
    (a / "ladder" / "result.json").write_text(json.dumps(saved))
    assert main(["doctor", str(a), str(b), "--offline"]) == 1  # the well-formed one is read
    assert "localize:" in capsys.readouterr().out
    (a / "ladder" / "result.json").write_text(json.dumps({**saved, **change}))
    assert main(["doctor", str(a), str(b), "--offline"]) == 2
    assert f"result.json: not a ladder result ({message}" in capsys.readouterr().err


def _aux_only_pair(tmp_path, recipe: dict, provider: str = "default"):
    """Two runs whose aux_loss differs in its last bit at step 3 while lm_loss stays equal (the fused-aux-
    loss signature), their manifests holding ``recipe`` and ``provider`` as bitdet train records them."""
    import json

    from test_compare import flip_low_bit, write_run

    def flip(step, rank, line):
        if step >= 3:
            line["metrics"]["aux_loss"] = flip_low_bit(line["metrics"]["aux_loss"])
            line["metrics"]["loss"] = flip_low_bit(line["metrics"]["loss"])

    runs = write_run(tmp_path / "a"), write_run(tmp_path / "b", edit=flip)
    for run in runs:
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["recipe"] = recipe
        manifest["scope"]["model_provider"] = provider
        (run / "manifest.json").write_text(json.dumps(manifest))
    return [str(r) for r in runs]


@pytest.mark.parametrize("recipe, provider, advice", [
    ({"model": {"moe": {"router_fusion": True}}, "determinism": {"swaps": False}}, "default",
     "bitdet fixcheck --recipe RECIPE --fix determinism.swaps=true"),  # the catalog's own advice changes something
    ({"model": {"moe": {"router_fusion": True}}, "determinism": {"swaps": True}}, "default",
     "bitdet fixcheck --recipe RECIPE --fix model.moe.router_fusion=false"),
    ({"model": {"moe": {"router_fusion": False}}, "determinism": {"swaps": True}}, "my.models:provider",
     "bitdet fixcheck --recipe RECIPE --model-provider my.models:provider --fix-provider MODULE:FIXED_PROVIDER"),
])
def test_doctor_never_advises_what_the_runs_already_have(tmp_path, capsys, recipe, provider, advice):
    """The runs' manifests say what was set: a fix already in effect in both is never the next step."""
    a, b = _aux_only_pair(tmp_path, recipe, provider)
    assert main(["doctor", a, b, "--offline"]) == 1
    out = capsys.readouterr().out
    assert _causes(out)[0] == "moe_fused_aux_loss", out
    assert f"next: {advice}\n" in out + "\n", out
    if recipe["determinism"]["swaps"]:
        assert "determinism.swaps=true is already set in both runs" in out, out
