"""Megatron-LM's FP4 flags (``--fp4-format e2m1 --fp4-recipe nvfp4``) are judged: megatron-core routes
them to Transformer Engine's NVFP4BlockScaling whatever the spec; bitdet fingerprints only its emulated
NVFP4 linears, so the launch is refused (exit 2) on every machine, naming the TE version and GPU generation
it found against what NVFP4 needs (TE >= 2.7, compute capability >= 10.0) and where bitdet's emulation runs
instead, before any rank trains; the recipe <-> flags table renders a recipe's ``model.fp4`` as those flags."""
from pathlib import Path

import pytest
import torch

from megatron_bitdet.cli import main as bitdet
from megatron_bitdet.megatron_lm.args import render_flags, te_fp4_facts, te_fp4_refusal
from megatron_bitdet.recipe import load_recipe
from test_megatron_lm import GPT, MAMBA, launch, script

FP4 = ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]
pytestmark = [pytest.mark.megatron_lm, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[1]


def test_fp4_flags_are_judged_and_refused_on_cpu_with_the_reason(capsys):
    rc = bitdet(["megatron-lm", "--check", script("pretrain_mamba.py"), *MAMBA, *FP4])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--fp4-format e2m1 --fp4-recipe nvfp4 with the local spec" in err
    assert "no FP4 path" in err and "recipes/nemotron_h_tiny_fp4.yaml" in err


UNPROVEN = "not Transformer Engine's NVFP4 tensors: a TE NVFP4 run's FP4 would go unproven"


@pytest.mark.parametrize("te, capability, found", [
    (None, None, ["transformer_engine does not import here", "no CUDA device here"]),
    ("2.6.0", (10, 0), ["Transformer Engine >= 2.7 (NVFP4BlockScaling); found 2.6.0"]),
    ("2.8.0+cu12", (9, 0), ["a Blackwell GPU (compute capability >= 10.0); found 9.0"]),   # an H100
    ("2.7.0", (12, 0), []),                                                                 # what NVFP4 needs
])
def test_fp4_under_te_names_what_is_found_against_what_is_needed(te, capability, found):
    reason = te_fp4_refusal(te, capability)
    assert all(f in reason for f in found) and reason.count("needs ") == len(found)
    assert reason.endswith("so bitdet refuses it on every machine") and UNPROVEN in reason


def test_fp4_under_te_is_refused_through_the_judging_path_with_this_machines_facts(capsys):
    """pretrain_gpt.py's TE path (Megatron's default --transformer-impl): the facts read off this machine."""
    rc = bitdet(["megatron-lm", "--check", script("pretrain_gpt.py"), *GPT, "--transformer-impl",
                 "transformer_engine", *FP4])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2
    assert f"--fp4-format e2m1 --fp4-recipe nvfp4 under Transformer Engine: {te_fp4_refusal(*te_fp4_facts())}" in err
    te, capability = te_fp4_facts()
    assert (capability is None) == (not torch.cuda.is_available())
    if te is None and capability is None:  # this CPU machine: the path says so
        assert "transformer_engine does not import here; needs a Blackwell GPU (compute capability >= 10.0); " \
               "no CUDA device here" in err


def test_a_launch_with_fp4_flags_is_refused_before_any_rank_trains(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert launch(run_dir, "pretrain_mamba.py", MAMBA, *FP4) == 2
    assert "--fp4-format e2m1 --fp4-recipe nvfp4" in capsys.readouterr().err
    assert not (run_dir / "fingerprints").exists()


def test_the_fp4_recipe_renders_megatrons_fp4_flags():
    flags = render_flags(load_recipe(str(ROOT / "recipes" / "nemotron_h_tiny_fp4.yaml")))
    assert flags[flags.index("--fp4-format"):][:4] == FP4
    assert "--fp4-format" not in render_flags(load_recipe(str(ROOT / "recipes" / "nemotron_h_tiny.yaml")))
