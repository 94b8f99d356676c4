"""``determinism.reductions: dp_invariant`` under Megatron-LM's own loop (issue 51 item 1): the README's hybrid
``M*-E`` line (Mamba-2, attention, MLP, MoE; dropout 0.1) on the checkout's hybrid entry point, EP 1, no distributed
optimizer, V = 4, 2 micro-batches a virtual rank, run at DP 1, 2 and 4 on real gloo ranks: bitwise-equal
metrics and logical digests at every step; without the mode DP 1 and DP 4 differ and ``compare`` refuses
them; a line the mode is not installed for is refused before any rank starts, naming each flag; the DP 4
run's Megatron-LM checkpoint resumed at DP 2 continues bitwise (``verify-resume --resume-nproc``), and its
step 3 replays bitwise on one rank from that checkpoint (``replay --nproc 1``).

Launches are shared through a module fixture (five: the mode at DP 1, 2, 4 -- the last also the
verify-resume reference, with a snapshot as step 3 begins, and saving at 2 --; c10d's reductions at DP 1, 4).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_bitdet.cli import main as bitdet
from test_megatron_lm import HYBRID, MAMBA, last_json, script

pytestmark = [pytest.mark.megatron_lm, pytest.mark.timeout(1800)]

V = 4
LOGICAL = {"logical_params", "logical_grads", "logical_exp_avg", "logical_exp_avg_sq"}


def plain_dp(line: list) -> list:
    """The README's line with what the mode is installed for: EP 1, no distributed optimizer, and a global
    batch of V x 2 micro-batches of 1 (2 per virtual rank: the dealing order matters)."""
    out = [a for a in line if a != "--use-distributed-optimizer"]
    for flag, value in (("--expert-model-parallel-size", "1"), ("--micro-batch-size", "1"),
                        ("--global-batch-size", str(2 * V))):
        out[out.index(flag) + 1] = value
    return out


LINE = plain_dp(MAMBA)


def mode_recipe(path: Path) -> Path:
    """A recipe agreeing with ``LINE``, asking for the mode."""
    path.write_text(
        "name: line\nmodel: {hybrid_pattern: 'M*-E', hidden_size: 64, ffn_hidden_size: 128,\n"
        "  num_attention_heads: 4, seq_length: 64, vocab_size: 256, moe: {num_experts: 4, ffn_hidden_size: 64}}\n"
        f"training: {{micro_batch_size: 1, global_batch_size: {2 * V}}}\n"
        f"determinism: {{reductions: dp_invariant, virtual_dp: {V}}}\n")
    return path


def compared(capsys, a: Path, b: Path, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = bitdet(["compare", "--json", str(a), str(b), *extra])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm_dp_invariant")
    recipe = mode_recipe(root / "dp.yaml")
    out = {"recipe": (recipe, 0)}
    for name, nproc, extra in (("dp1", 1, ["--recipe", str(recipe)]), ("dp2", 2, ["--recipe", str(recipe)]),
                               ("dp4", 4, ["--recipe", str(recipe), "--snapshot-at", "2", "--save",
                                           str(root / "ckpt4"), "--save-interval", "2"]),
                               ("native1", 1, []), ("native4", 4, [])):
        run = root / name
        rc = bitdet(["megatron-lm", "--nproc", str(nproc), "--run-dir", str(run), script(HYBRID),
                     *LINE, *extra])
        out[name] = (run, rc)
    return out


def test_the_mode_at_dp_1_2_and_4_gives_bitwise_equal_steps(runs, capsys):
    """Every rank's metrics (lm loss, aux losses, grad norm, lr) and the logical digests of params, reduced
    grads and Adam's moments, at all 3 steps; the manifest records each layout's hosted virtual ranks."""
    assert {k: rc for k, (_, rc) in runs.items()} == dict.fromkeys(runs, 0)  # a snapshot perturbs no bit
    for a, b in (("dp1", "dp4"), ("dp2", "dp4")):
        rc, res = compared(capsys, runs[a][0], runs[b][0])
        assert (rc, res["verdict"]) == (0, "match"), res
        assert res["steps_compared"] == 3 and res["ranks_compared"] == [0, 1, 2, 3]
        assert {"lm_loss", "aux_loss", "aux_loss/load_balancing_loss/layer_04", "grad_norm", "lr"} <= set(
            res["metrics_compared"])
        assert LOGICAL <= set(res["digests_compared"])
    hosted = {}
    for name in ("dp1", "dp2", "dp4"):
        manifest = json.loads((runs[name][0] / "manifest.json").read_text())
        record, = [p for p in manifest["patches"] if isinstance(p, dict) and p.get("id") == "dp_invariant_reductions"]
        hosted[name] = record["virtual_layout"]["hosted_virtual_ranks"]
        assert "megatron.core.optimizer.optimizer:get_grad_norm_fp32" in record["bindings"]
    assert hosted == {"dp1": {"0": [0, 2, 1, 3]}, "dp2": {"0": [0, 2], "1": [1, 3]},
                      "dp4": {str(r): [r] for r in range(4)}}


def test_without_the_mode_dp_1_and_4_differ_and_compare_refuses_them(runs, capsys):
    rc, res = compared(capsys, runs["native1"][0], runs["native4"][0])
    assert (rc, res["verdict"]) == (2, "unusable")
    assert {m["key"] for m in res["scope_mismatches"]} == {"dp", "world_size"}
    rc, res = compared(capsys, runs["native1"][0], runs["native4"][0], "--force", "--ranks", "0")
    assert (rc, res["verdict"]) == (1, "diverged")
    assert res["first_divergence"]["step"] == 1
    assert {"lm_loss", "grad_norm"} <= set(res["first_divergence"]["metrics"])


def test_a_line_the_mode_is_not_installed_for_is_refused_before_any_rank_naming_each_flag(tmp_path, capsys):
    """Fail closed: the distributed optimizer, and a DP (8) that does not divide V, in one report."""
    recipe = mode_recipe(tmp_path / "dp.yaml")
    rc = bitdet(["megatron-lm", "--nproc", "8", "--run-dir", str(tmp_path / "run"), script(HYBRID),
                 *LINE, "--use-distributed-optimizer", "--recipe", str(recipe)])
    err = capsys.readouterr()
    text = err.out + err.err
    assert rc == 2, text
    assert (f"[reductions_not_installed] determinism.reductions is dp_invariant ({recipe}:5) with "
            "--use-distributed-optimizer; determinism.virtual_dp=4 is not divisible by the data-parallel size 8") in text
    assert "fix: drop --use-distributed-optimizer; launch at a data-parallel size dividing 4" in text
    assert not (tmp_path / "run" / "fingerprints").exists()


def test_a_dp_4_checkpoint_resumed_at_dp_2_continues_bitwise(runs, tmp_path, capsys):
    """verify-resume --resume-nproc 2 on the DP 4 run: Megatron-LM's own --save at 2 (DP 4) loaded by a DP 2
    launch; the restored state (Adam's moments included, every rank's logical partial added) and step 3 equal
    the uninterrupted DP 4 run's."""
    capsys.readouterr()
    rc = bitdet(["verify-resume", "--megatron-lm", script(HYBRID), "--resume-at", "2", "--nproc", "4",
                 "--resume-nproc", "2", "--out", str(tmp_path), "--reference", str(runs["dp4"][0]), "--json",
                 "--", *LINE, "--recipe", str(runs["recipe"][0])])
    report = last_json(capsys.readouterr())
    assert rc == 0 and report["holds"] and report["resume_nproc"] == 2, report
    logical = {c["key"].split()[0]: c["equal"] for c in report["checks"] if c["component"] == "logical"}
    assert logical == {"params": True, "exp_avg": True, "exp_avg_sq": True}, logical
    assert {c["rank"] for c in report["checks"]} == {0, 1}
    assert [p["steps_compared"] for p in report["points"]] == [[1, 2], [3]]


def test_a_dp_4_step_replays_bitwise_on_one_rank_from_its_checkpoint(runs, tmp_path, capsys):
    """replay --nproc 1 --context 0 of the DP 4 run's step 3: Megatron-LM's DP 4 checkpoint at 2 loaded by one
    rank hosting the 4 virtual ranks, step 3 compared with the original as one logical rank."""
    capsys.readouterr()
    rc = bitdet(["replay", str(runs["dp4"][0]), "--step", "3", "--nproc", "1", "--context", "0", "--out",
                 str(tmp_path / "replay"), "--json"])
    result = last_json(capsys.readouterr())
    assert rc == 0 and result["verdict"] == "reproduced", result
    assert (result["checkpoint"], result["verified"]) == (2, [3])


def test_a_run_without_the_mode_is_not_replayed_at_another_dp(runs, capsys):
    rc = bitdet(["replay", str(runs["native4"][0]), "--step", "1", "--nproc", "1"])
    assert rc == 2
    assert "--nproc 1 (the run has 4 ranks): the recipe runs determinism.reductions=native" in capsys.readouterr().err
