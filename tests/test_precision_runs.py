"""Low precision on real 2-rank gloo training: bf16 mixed precision (plain and distributed optimizer),
emulated FP8 (delayed scaling, bf16 params) and emulated NVFP4 (NVIDIA's recipe, bf16 params) are
bitwise equal independently and across a 2-restore resume chain, with the fp32 source, the bf16
compute copy, the FP8 scaling state and the NVFP4 state (rounding generators, Hadamard signs, weight
encodings) checked after every restore; a restore that rounds the compute copy another way, drops
the amax history, leaves the NVFP4 rounding generators or encodings fresh or re-draws the Hadamard
signs is caught by name. Per configuration one `bitdet verify-resume` invocation as the README writes it
(reference + 2-restore chain) and one independent twin, shared by this module; the negative controls
continue from the FP8 chain's fresh segment (0 -> 2)."""
import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from conftest import faulted_chain
from megatron_bitdet.analysis.compare import compare_runs
from megatron_bitdet.cli import main
from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.train.run import RunOptions, launch_training

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = ["training.iterations=4"]
RESUME_AT = [2, 3]
CONFIGS = {
    "bf16": ("nemotron_h_tiny_bf16.yaml", ["parallel.distributed_optimizer=false"]),
    "bf16_distopt": ("nemotron_h_tiny_bf16.yaml", []),
    "fp8": ("nemotron_h_tiny_fp8.yaml", []),
    "fp4": ("nemotron_h_tiny_fp4.yaml", []),
}
SCOPE = {"bf16": "bfloat16", "bf16_distopt": "bfloat16", "fp8": "bfloat16 fp8:delayed/hybrid",
         "fp4": "bfloat16 fp4:nvfp4/e2m1[2d_weights,hadamard,stochastic_rounding]"}
FP4_STATE = {"fp4_sr_rng", "fp4_hadamard_signs", "fp4_block_scales", "fp4_values"}
# without the distributed optimizer Adam's moments are replicated regions, digested every step (bitdet check)
DIGESTS = {"bf16": {"params", "grads", "main_params", "buffers", "exp_avg", "exp_avg_sq"},
           "bf16_distopt": {"params", "grads", "main_params", "buffers"},
           "fp8": {"params", "grads", "main_params", "buffers", "fp8_values", "fp8_scales"},
           "fp4": {"params", "grads", "main_params", "buffers", "generators", "fp4_values", "fp4_scales"}}
# bf16 with the distributed optimizer: a matrix case beyond the default run (the bf16 twins above cover bf16)
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n == "bf16_distopt" else n for n in CONFIGS]
STATE = {"bf16_compute_copy", "fp32_main_params", "buffers", "optimizer", "scheduler", "rng.python", "rng.numpy",
         "rng.torch_cpu", "rng.tracker", "data"}

pytestmark = pytest.mark.timeout(600)


def _recipe(name):
    path, overrides = CONFIGS[name]
    return load_recipe(str(ROOT / "recipes" / path), [*ITERATIONS, *overrides])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per configuration, made on first use: the verify-resume report (JSON) with its reference, and a twin."""
    made = {}

    def get(name):
        if name not in made:
            path, overrides = CONFIGS[name]
            root = tmp_path_factory.mktemp(name)
            out = io.StringIO()
            with redirect_stdout(out):
                rc = main(["verify-resume", "--recipe", str(ROOT / "recipes" / path), "--resume-at", "2,3",
                           "--out", str(root / "chain"), "--json", *ITERATIONS, *overrides])
            text = out.getvalue()
            assert rc == 0, text[-3000:]
            report = json.loads(text[text.index("{\n"):])
            recipe = _recipe(name)
            assert launch_training(recipe, RunOptions(nproc=2, run_dir=root / "twin")) == 0
            made[name] = (recipe, Path(report["reference_dir"]), root / "twin", report)
        return made[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_independent_runs_are_bitwise_equal(runs, name):
    recipe, reference, twin, _ = runs(name)
    result = compare_runs(reference, twin)
    assert result.first_divergence is None
    assert [s.step for s in result.per_step] == [1, 2, 3, 4]
    assert set(result.digests_compared) == DIGESTS[name]
    line = (reference / "fingerprints" / "rank_00000.jsonl").read_text().splitlines()[0]
    assert '"main_params":"xxh3_64:' in line  # CPU tensors: the digests' host fast path
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["scope"]["precision"] == SCOPE[name]
    assert ("fp4_emulated_linear" in {p["id"] for p in manifest["patches"]}) == (name == "fp4")


@pytest.mark.parametrize("name", NAMES)
def test_two_restore_chain_checks_source_and_compute_copy(runs, name):
    recipe, reference, _, report = runs(name)
    assert report["holds"] is True
    assert [p["steps_compared"] for p in report["points"]] == [[1, 2], [3], [4]]
    expected = STATE | ({"fp8_scaling"} if name == "fp8" else FP4_STATE if name == "fp4" else set())
    for step in RESUME_AT:
        for rank in (0, 1):
            components = {c["component"] for c in report["checks"] if c["resume_step"] == step and c["rank"] == rank}
            # NVFP4's rounding generators are also module generators (rng.module:<where>)
            assert {c for c in components if not c.startswith("rng.module:")} == expected
    assert all(c["equal"] for c in report["checks"])
    from megatron_bitdet.rundir import snapshot_path
    from megatron_bitdet.train.snapshot import read_snapshot, tensor_digest

    snap = read_snapshot(snapshot_path(reference, 2, 0)).leaves
    assert {d.dtype for (c, _), d in snap.items() if c == "bf16_compute_copy"} == {"bfloat16"}
    assert {d.dtype for (c, _), d in snap.items() if c == "fp32_main_params"} == {"float32"}
    if name == "fp8":
        scaling = {k: d for (c, k), d in snap.items() if c == "fp8_scaling"}
        assert {d.dtype for d in scaling.values()} == {"float32"}
        assert any(k.endswith("fp8_amax_history") and d != tensor_digest(torch.zeros(d.shape))  # a history kept
                   for k, d in scaling.items())


def test_compute_copy_rounded_another_way_and_dropped_fp8_state_are_named(runs, tmp_path):
    """Negative controls, both in one resumed segment of the FP8 run (bf16 params, distributed
    optimizer): the bf16 copy rebuilt from the fp32 source rounding toward zero instead of training's
    nearest-even conversion, and the FP8 amax history / scales left as a fresh model has them. Each
    is named as its own component; the fp32 source itself is intact."""
    recipe, reference, _, chain = runs("fp8")
    report = faulted_chain(recipe, [2], ["compute_copy.rounding", "fp8.amax_history"],
                           fresh_segment=chain["points"][0]["run_dir"], reference_dir=reference, out_dir=tmp_path)
    assert not report.holds
    fresh, resumed = report.points
    # The amax history is also a module buffer, so every-buffer check names it too.
    assert fresh.holds and set(resumed.failing_components) == {"bf16_compute_copy", "buffers", "fp8_scaling"}
    for component in ("bf16_compute_copy", "fp8_scaling"):
        assert {c.rank for c in report.failures if c.component == component} == {0, 1}
    assert all(c.equal for c in report.checks if c.component in ("fp32_main_params", "optimizer"))
    assert any(c.key.endswith("fp8_amax_history") for c in report.failures)
    assert resumed.first_output_divergence == 3
    assert "bf16_compute_copy differs" in report.summary() and "fp8_scaling differs" in report.summary()


# fault -> the components it must fail: its own, plus where the same state also lives (the generators
# are module generators, rng.module:<where>; the encodings and signs are module buffers)
FP4_FAULTS = {"fp4.sr_rng": {"fp4_sr_rng", "rng.module"}, "fp4.block_scales": {"fp4_block_scales", "fp4_values", "buffers"},
              "fp4.hadamard_signs": {"fp4_hadamard_signs", "buffers"}}


@pytest.mark.parametrize("fault,component", [("fp4.sr_rng", "fp4_sr_rng"), ("fp4.block_scales", "fp4_block_scales"),
                                             ("fp4.hadamard_signs", "fp4_hadamard_signs")])
def test_fp4_state_left_wrong_by_a_restore_is_named(runs, tmp_path, fault, component):
    """Negative controls of the NVFP4 run (one resumed segment each, continuing the chain's fresh
    0 -> 2 segment): the rounding generators left as built, the weights' encodings (packed values,
    block and per-tensor scales) left fresh, the Hadamard signs re-drawn. Each is named as its own
    component on both ranks; parameters, optimizer and the other NVFP4 parts are intact. The generator
    and the signs change the next step's gradients; the encoding is rewritten by the next forward, so
    only the restore check sees it."""
    recipe, reference, _, chain = runs("fp4")
    report = faulted_chain(recipe, [2], [fault], fresh_segment=chain["points"][0]["run_dir"],
                           reference_dir=reference, out_dir=tmp_path)
    assert not report.holds
    fresh, resumed = report.points
    assert fresh.holds
    assert {c.split(":")[0] for c in resumed.failing_components} == FP4_FAULTS[fault]
    assert {c.rank for c in report.failures if c.component == component} == {0, 1}
    assert f"{component} differs" in report.summary()
    assert resumed.first_output_divergence == (None if fault == "fp4.block_scales" else 3)
