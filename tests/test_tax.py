"""bitdet tax on the tiny hybrid: one real 2-rank gloo launch, every side built and stepped per rank."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from megatron_bitdet.workflows.tax import TaxConfig, _stats, measure_tax
from megatron_bitdet.workflows.tax_worker import op_group
from megatron_bitdet.cli import main
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.recipe import load_recipe

RECIPE = "recipes/nemotron_h_tiny.yaml"


@pytest.fixture(scope="module")
def tax_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tax")


@pytest.fixture(scope="module")
def tax(tax_dir):
    recipe = load_recipe(RECIPE)
    return measure_tax(recipe, nproc=2, rounds=2, warmup=1, profile_steps=1, out_dir=tax_dir)


def test_every_side_has_finite_positive_figures(tax):
    sides = [tax.deterministic, *tax.candidates]
    assert [s.name for s in tax.candidates] == ["baseline[sequential]", "baseline[grouped]"]
    for s in sides:
        assert len(s.step_ms) == 2
        for x in (s.median_ms, s.p10_ms, s.p90_ms, s.tokens_per_s, s.peak_memory_mib):
            assert math.isfinite(x) and x > 0, (s.name, x)
        assert s.p10_ms <= s.median_ms <= s.p90_ms
        assert s.comm_ms >= 0 and s.op_groups_ms and sum(s.op_groups_ms.values()) > 0


def test_tax_follows_from_what_the_ranks_measured(tax, tax_dir):
    """From the ranks' own raw step times (tax_raw.json), by the brief's definition: a step lasts as long
    as its slowest rank, each side's step time is the median over the rounds, the baseline is the fastest
    nondeterministic candidate, tax = (deterministic / baseline - 1) x 100%."""
    raw = json.loads((tax_dir / "tax_raw.json").read_text())["ranks"]
    names = [side["name"] for side in raw[0]]
    per_side = {name: [max(rank[i]["step_s"][k] for rank in raw) * 1000 for k in range(2)]
                for i, name in enumerate(names)}
    median = {name: statistics.median(times) for name, times in per_side.items()}
    baseline = min((n for n in names if n.startswith("baseline")), key=median.__getitem__)
    expected = (median["deterministic"] / median[baseline] - 1) * 100
    assert (tax.baseline.name, tax.tax_percent) == (baseline, expected)
    report = tax.to_report_dict()
    assert report["tax_percent"] == expected
    assert report["step_time_ms"]["deterministic"]["median"] == median["deterministic"]
    assert report["step_time_ms"]["baseline"]["median"] == median[baseline]
    assert set(report) == {"tax_percent", "step_time_ms", "op_groups_ms", "comm_ms", "peak_memory_mib"}


def test_side_stats_worked_example():
    """Two ranks, three rounds, times chosen exact in binary: the slowest rank per step is 500, 500 and
    375 ms, so the median is 500 ms and 1000 tokens a step make 2000 tokens/s."""
    side = {"name": "deterministic", "deterministic": True,
            "recipe": {"model": {"hybrid_pattern": "M*", "moe": {"expert_impl": "grouped"}}}}
    rank = {"comm_s": [0.0] * 3, "peak_mib": [1.0] * 3, "op_groups_ms": {}, "top_ops_ms": {}, "op_calls": {},
            "det_flag_seen": [True], "invariant_seen": [False]}
    stats = _stats(side, [{**rank, "step_s": [0.5, 0.25, 0.375]}, {**rank, "step_s": [0.25, 0.5, 0.125]}], 1000)
    assert (stats.step_ms, stats.median_ms, stats.tokens_per_s) == ([500.0, 500.0, 375.0], 500.0, 2000.0)


def test_baseline_steps_really_ran_nondeterministic(tax):
    """Recorded inside each side's steps on every rank, not assumed from the recipe."""
    assert tax.deterministic.det_algorithms_enabled == [True]
    for s in tax.candidates:
        assert s.det_algorithms_enabled == [False], s.name


def test_result_serializes(tax):
    import json

    d = json.loads(tax.to_json())
    assert d["tax_percent"] == tax.tax_percent and d["dominant"]


@pytest.mark.parametrize("name,group", [("aten::mm", "matmul"), ("c10d::alltoall_base_", "communication"),
                                        ("_AllToAll", "communication"), ("aten::index_put_", "moe permute / index"),
                                        ("aten::cumsum", "ssm scan / conv"), ("aten::fill_", "fill / copy"),
                                        ("aten::_foreach_mul_", "optimizer"), ("aten::relu", "other")])
def test_op_groups(name, group):
    assert op_group(name) == group


def test_bad_input_is_refused_before_any_launch(tmp_path):
    with pytest.raises(BitdetInputError, match="rounds"):
        TaxConfig(rounds=1)
    with pytest.raises(BitdetInputError, match="determinism.mode must be true"):
        measure_tax(load_recipe(RECIPE, ["determinism.mode=false"]), nproc=2, out_dir=tmp_path)
    assert main(["tax", "--recipe", RECIPE, "--rounds", "1", "--out", str(tmp_path)]) == 2
    assert main(["tax", "--recipe", RECIPE, "--nproc", "3", "--out", str(tmp_path)]) == 2


def test_a_rank_that_refuses_its_input_exits_2_not_measurement_failed(tmp_path, monkeypatch):
    """A refusal that only a rank can make (here a model provider that raises BitdetInputError while
    building) exits 2, as every other launch does; it read as exit 1, 'tax measurement failed'."""
    recipe = load_recipe(RECIPE)
    (tmp_path / "refusing_provider.py").write_text(
        "from megatron_bitdet.errors import BitdetInputError\n\n\n"
        "def provider(recipe, config, **kwargs):\n"
        "    raise BitdetInputError('refusing_provider: this model cannot be built here')\n")
    monkeypatch.chdir(tmp_path)  # the ranks import the provider from their working directory
    with pytest.raises(BitdetInputError, match=r"tax measurement failed \(exit 2\)"):
        measure_tax(recipe, nproc=2, rounds=2, warmup=0, profile_steps=1, out_dir=tmp_path / "out",
                    model_provider="refusing_provider:provider")
