"""Megatron-LM's FP4 flags (``--fp4-format e2m1 --fp4-recipe nvfp4``) are judged: megatron-core routes
them to Transformer Engine's NVFP4BlockScaling whatever the spec, so where TE or a GPU is missing the
launch is refused (exit 2) naming what it needs and where bitdet's emulation runs instead, before any
rank trains; the recipe <-> flags table renders a recipe's ``model.fp4`` as those flags."""
from pathlib import Path

import pytest

from megatron_bitdet.cli import main as bitdet
from megatron_bitdet.megatron_lm.args import render_flags
from megatron_bitdet.recipe import load_recipe
from test_megatron_lm import MAMBA, launch, script

FP4 = ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]
pytestmark = [pytest.mark.megatron_lm, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[1]


def test_fp4_flags_are_judged_and_refused_on_cpu_with_the_reason(capsys):
    rc = bitdet(["megatron-lm", "--check", script("pretrain_mamba.py"), *MAMBA, *FP4])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--fp4-format e2m1 --fp4-recipe nvfp4 with the local spec" in err
    assert "no FP4 path" in err and "recipes/nemotron_h_tiny_fp4.yaml" in err


def test_a_launch_with_fp4_flags_is_refused_before_any_rank_trains(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert launch(run_dir, "pretrain_mamba.py", MAMBA, *FP4) == 2
    assert "--fp4-format e2m1 --fp4-recipe nvfp4" in capsys.readouterr().err
    assert not (run_dir / "fingerprints").exists()


def test_the_fp4_recipe_renders_megatrons_fp4_flags():
    flags = render_flags(load_recipe(str(ROOT / "recipes" / "nemotron_h_tiny_fp4.yaml")))
    assert flags[flags.index("--fp4-format"):][:4] == FP4
    assert "--fp4-format" not in render_flags(load_recipe(str(ROOT / "recipes" / "nemotron_h_tiny.yaml")))
