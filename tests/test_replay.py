"""bitdet replay on real 2-rank training. One run of examples/planted_spike.py (expert 1 of layer 2 scaled
at step 5, the output layer's weights scaled at step 7; checkpoints every 2 steps) is replayed from its
checkpoint at 4 to 7 and verified bit for bit; another thread count is named as a scope difference, at the
first differing step or beside bits that match (which of the two is the CPU's); the ranking puts the planted
module first and the counterfactual that removes it brings the loss back within the previous steps' range;
bad input exits 2 before any launch."""
import json
import os
import re
from pathlib import Path

import pytest
import torch

from megatron_bitdet.analysis.spike import Departure, departure_key
from megatron_bitdet.cli import main
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.trace.module_stats import read_stats
from megatron_bitdet.train.run import RunOptions, launch_training

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "nemotron_h_tiny.yaml"
PLANTED = "examples.planted_spike:provider"
K = 7  # examples/planted_spike.py: OUTPUT_STEP (output_layer weights x10)
K_EXPERT = 5  # EXPERT_STEP (expert 1 of layer 2)
PLANTED_EXPERT = "decoder.layers.2.mlp.experts.expert_1"


@pytest.fixture(scope="module", autouse=True)
def at_root():
    cwd = os.getcwd()
    os.chdir(ROOT)  # the ranks import the example provider from the repository root
    yield
    os.chdir(cwd)


@pytest.fixture(scope="module")
def spike_run(tmp_path_factory, at_root) -> Path:
    run = tmp_path_factory.mktemp("spike") / "run"
    recipe = load_recipe(RECIPE, ["training.iterations=8"])
    assert launch_training(recipe, RunOptions(nproc=2, run_dir=run, model_provider=PLANTED, save_interval=2)) == 0
    return run


def lines(run: Path, rank: int) -> dict[int, bytes]:
    raw = (run / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes().splitlines()
    return {json.loads(line)["step"]: line for line in raw}


def replay_cli(capsys, *argv) -> tuple[int, str]:
    rc = main(["replay", *map(str, argv)])
    return rc, capsys.readouterr().out


def result(out_dir: Path) -> dict:
    return json.loads((out_dir / "replay.json").read_text())


@pytest.mark.timeout(600)
def test_replay_reproduces_the_steps_bitwise_and_ranks_the_planted_module_first(spike_run, capsys):
    rc, text = replay_cli(capsys, spike_run, "--step", K)
    out = spike_run / "replay" / f"step_{K}"
    r = result(out)
    assert rc == 0, text
    assert r["verdict"] == "reproduced" and r["checkpoint"] == 4 and r["verified"] == [5, 6, 7]
    for rank in (0, 1):  # byte for byte, independently of the tool's own verdict
        orig, rep = lines(spike_run, rank), lines(out, rank)
        assert sorted(rep) == [5, 6, 7] and all(rep[s] == orig[s] for s in rep)
    assert f"steps 5-7 bitwise equal to the original" in text
    top = r["ranking"][0]
    assert top["module"] == "output_layer" and top["by"].startswith("out_"), r["ranking"][:3]
    assert text.split("output_layer")[0].count("decoder.") == 0  # printed first
    # the spike is real: step 7's loss is above both previous steps'
    assert r["loss"][str(K)] > r["previous_range"][1]
    # every layer and every expert has a row; routers report 4 experts for both MoE layers
    modules = {d["module"] for d in r["ranking"]}
    assert {f"decoder.layers.{i}" for i in range(6)} <= modules
    assert {f"decoder.layers.{lay}.mlp.experts.expert_{e}" for lay in (2, 5) for e in range(4)} <= modules
    assert set(r["routers"]) == {"decoder.layers.2.mlp.router", "decoder.layers.5.mlp.router"}
    assert all(len(v) == 4 for by_step in r["routers"].values() for v in by_step.values())
    stats = read_stats(out / "stats" / "rank_00000.stats.jsonl")
    assert sorted(stats) == [5, 6, 7]
    # merged view: each module's row is from the rank where it departs most
    for d in r["ranking"][:20]:
        views = [Departure(**{**x, "previous": tuple(x["previous"])})
                 for rows in r["per_rank"].values() for x in rows if x["module"] == d["module"]]
        assert min(views, key=departure_key).to_json() == {**d, "previous": tuple(d["previous"])}


@pytest.mark.timeout(600)
def test_replay_under_another_thread_count_names_the_scope_whether_or_not_the_bits_change(spike_run, capsys,
                                                                                         machine_outcome):
    """Whether 1 and 2 threads give different bits is a fact about the CPU (they did on AMD EPYC, not on an
    Intel Xeon): the truth is read from the fingerprint bytes, and the replay must report that outcome with
    the scope named: diverged at the first differing step (cause: the scope), or reproduced with a note."""
    out = spike_run.parent / "threads1"
    rc, text = replay_cli(capsys, spike_run, "determinism.threads=1", "--step", K, "--out", out)
    r = result(out)
    orig, rep = [lines(spike_run, rank) for rank in (0, 1)], [lines(out, rank) for rank in (0, 1)]
    differing = [s for s in (5, 6, 7) if any(s in p and p[s] != o[s] for o, p in zip(orig, rep))]
    machine_outcome("1 vs 2 threads: " + (f"bits differ from step {differing[0]}" if differing
                                          else "bits identical over steps 5-7"))
    if differing:
        first = differing[0]
        assert rc == 1, text
        assert r["verdict"] == "diverged" and r["first_difference"]["step"] == first
        assert r["verified"] == list(range(5, first)) and r["cause"].startswith("scope difference")
        assert f"DIFFERS at step {first}" in text and "torch_threads: original 2, replay 1" in text
        assert all(sorted(p) == list(range(5, first + 1)) for p in rep)  # every rank stopped at the first difference
    else:
        assert rc == 0, text
        assert r["verdict"] == "reproduced" and r["verified"] == [5, 6, 7]
        assert all(sorted(p) == [5, 6, 7] for p in rep)  # the whole window ran and matched byte for byte
        assert "steps 5-7 bitwise equal to the original" in text
        assert "note: scope differs in torch_threads (original 2, replay 1) yet the bits match" in text
    assert {"key": "torch_threads", "a": 2, "b": 1} in r["scope_differences"]


@pytest.mark.timeout(900)
def test_counterfactual_that_removes_the_plant_brings_the_loss_back_and_another_does_not(spike_run, capsys):
    rc, text = replay_cli(capsys, spike_run, "--step", K, "--counterfactual", "prev-params:output_layer",
                          "--counterfactual", "zero-expert:2.1")
    assert rc == 0, text
    base = spike_run / "replay"
    prev = result(base / f"step_{K}_previous_steps_params_for_output_layer")
    zero = result(base / f"step_{K}_zero_expert_1s_router_probability_in_layer_2")
    assert prev["change"] == {"kind": "prev-params", "module": "output_layer"}
    for r in (prev, zero):
        assert r["verified"] == [5, 6]
        for rank in (0, 1):  # bitwise up to the change, different at it
            orig, rep = lines(spike_run, rank), lines(Path(r["out"]), rank)
            assert rep[5] == orig[5] and rep[6] == orig[6] and rep[7] != orig[7]
    lo, hi = prev["previous_range"]
    assert prev["original_loss"] > hi >= prev["loss"][str(K)] and prev["within_range"] is True
    assert zero["loss"][str(K)] > hi and zero["within_range"] is False  # not the cause at step 7
    assert "previous step's params for output_layer" in text and "yes" in text and "no" in text


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_planted_expert_ranks_first_and_zeroing_it_brings_the_loss_back(spike_run, capsys):
    rc, text = replay_cli(capsys, spike_run, "--step", K_EXPERT, "--dump")
    r = result(spike_run / "replay" / f"step_{K_EXPERT}")
    assert rc == 0 and r["verified"] == [3, 4, 5]
    assert r["ranking"][0]["module"].startswith(PLANTED_EXPERT) and r["ranking"][0]["rank"] == 0
    dump = torch.load(r["dump"], weights_only=True)
    assert dump["module"] == r["ranking"][0]["module"] and dump["step"] == K_EXPERT
    assert dump["calls"] and all(c["inputs"] and c["outputs"] and c["grad_outputs"] for c in dump["calls"])
    rc, text = replay_cli(capsys, spike_run, "--step", K_EXPERT, "--counterfactual", "zero-expert:2.1", "--json")
    cf = json.loads(text)[0]
    assert rc == 0 and cf["verified"] == [3, 4] and cf["within_range"] is True


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("change", ["skip-microbatch:0", "skip-microbatch:1@1", "zero-expert:5.2",
                                    "prev-params:decoder.layers.2.mlp.experts.expert_1"])
def test_other_counterfactuals_are_verified_up_to_the_change(spike_run, capsys, change):
    rc, text = replay_cli(capsys, spike_run, "--step", K, "--counterfactual", change, "--json")
    r = json.loads(text)[0]
    assert rc == 0 and r["verified"] == [5, 6]
    assert r["loss"][str(K)] != r["original_loss"]


def fake_run(run: Path, recipe_dict: dict) -> Path:
    """A run directory with a manifest and 8 steps of fingerprints (inputs refused before any launch)."""
    (run / "fingerprints").mkdir(parents=True)
    recipe = load_recipe(RECIPE)
    manifest = {"bitdet_version": "0.0.1", "created": "x", "recipe": recipe_dict, "recipe_digest": recipe.digest(),
                "scope": {"world_size": 2}, "env": {}, "rules": {}, "patches": [], "argv": []}
    (run / "manifest.json").write_text(json.dumps(manifest))
    for rank in (0, 1):
        (run / "fingerprints" / f"rank_{rank:05d}.jsonl").write_text("".join(
            json.dumps({"v": 1, "step": s, "rank": rank, "metrics": {"lm_loss": "float32:40b00000"}}) + "\n"
            for s in range(1, 9)))
    return run


@pytest.mark.parametrize("argv, message", [
    (["--step", "99"], "step 99 is not in the original run"),
    (["--step", "7", "--counterfactual", "zero-expert:3.1"], "layer 3 is not a MoE layer"),
    (["--step", "7", "--counterfactual", "zero-expert:2.9"], "expert 9 out of range"),
    (["--step", "7", "--counterfactual", "swap:1"], "expected skip-microbatch:M[@RANK]"),
    (["--step", "7", "--counterfactual", "skip-microbatch:4"], "a rank runs 2 micro-batches"),
    (["--step", "7", "--context", "-1"], "--context -1"),
    (["--step", "1", "--counterfactual", "skip-microbatch:0"], "no step before the change would be reproduced"),
    (["model.nonsense=1", "--step", "7"], "model.nonsense"),
])
def test_bad_input_exits_2_before_any_launch(tmp_path, capsys, argv, message):
    run = fake_run(tmp_path / "run", load_recipe(RECIPE).to_dict())
    assert main(["replay", str(run), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (run / "replay" / "step_7" / "logs").exists()


def test_a_recipe_this_bitdet_does_not_accept_exits_2(tmp_path, capsys):
    recipe = load_recipe(RECIPE).to_dict()
    recipe["model"]["use_fla"] = False  # a key an older bitdet had
    assert main(["replay", str(fake_run(tmp_path / "run", recipe)), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "manifest.json: the run's recipe (bitdet 0.0.1) does not validate" in err and "use_fla" in err


def test_no_run_or_no_manifest_exits_2(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing"), "--step", "1"]) == 2
    assert "no fingerprints/ directory" in capsys.readouterr().err
    (tmp_path / "run" / "fingerprints").mkdir(parents=True)
    (tmp_path / "run" / "fingerprints" / "rank_00000.jsonl").write_text(
        json.dumps({"v": 1, "step": 1, "rank": 0, "metrics": {}}) + "\n")
    assert main(["replay", str(tmp_path / "run"), "--step", "1"]) == 2
    assert "no manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("content, where", [
    (b"", "empty module-stats file"),
    (b'{"format":"bitdet-trace","v":1}\n', ":1: foreign file"),
    (b'{"format":"bitdet-module-stats","v":1,"rank":0}\n{"step":1,"modules":{}', ":2: truncated final line"),
    (b'{"format":"bitdet-module-stats","v":1,"rank":0}\n\xff\xfe\n', ":2: not JSON"),
    (b'{"format":"bitdet-module-stats","v":1,"rank":0}\n{"step":1,"modules":{"m":{"out_max":"x"}},'
     b'"routers":{},"total_grad_sq":1}\n', ":2: module 'm': bad statistic(s) out_max"),
])
def test_module_stats_reader_names_the_file_and_line(tmp_path, content, where):
    path = tmp_path / "rank_00000.stats.jsonl"
    path.write_bytes(content)
    with pytest.raises(BitdetInputError, match=re.escape(str(path)) + ".*" + re.escape(where)):
        read_stats(path)


def test_a_corrupt_checkpoint_is_bad_input_refused_before_any_launch(spike_run, tmp_path, capsys):
    """A changed byte in the checkpoint the replay would start from: exit 2 naming it (a rank refusing
    it later read as exit 1, 'the replay failed')."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(spike_run, run, ignore=shutil.ignore_patterns("replay"))
    shard = next(p for p in sorted((run / "checkpoints" / "iter_0000004").iterdir()) if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    assert main(["replay", str(run), "--step", "6", "--context", "1"]) == 2
    err = capsys.readouterr().err
    assert "iter_0000004: checkpoint is corrupt" in err and shard.name in err
    assert not (run / "replay").exists()
