"""Shipped data through the installed package: recipes by name or path from any directory, patch
declarations from package data, metadata version = the code's. (tests/test_wheel_install.py does
the same from a built wheel in a fresh virtualenv.)"""
import importlib.metadata
from pathlib import Path

import pytest

import megatron_bitdet
from megatron_bitdet import resources
from megatron_bitdet.cli import main
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.compat.patching import load_declarations

REPO = Path(__file__).resolve().parents[1]


def test_every_shipped_kind_is_package_data_with_the_repository_files():
    for kind in resources.KINDS:
        shipped = sorted(p.name for p in resources.shipped_dir(kind).glob("*.yaml"))
        assert shipped == sorted(p.name for p in (REPO / kind).glob("*.yaml")) and shipped, kind
    assert [d.id for d in load_declarations()] == sorted(p.stem for p in (REPO / "patches").glob("*.yaml"))


def test_recipe_by_name_and_by_path_from_another_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["recipe", "validate", "nemotron_h_tiny"]) == 0
    by_name = capsys.readouterr().out
    assert by_name.startswith("OK nemotron_h_tiny:")
    assert main(["recipe", "validate", str(REPO / "recipes" / "nemotron_h_tiny.yaml")]) == 0
    assert capsys.readouterr().out == by_name  # same digest either way
    assert main(["recipe", "validate", "nemotron_h_8b.yaml"]) == 0  # extends ../configs/ resolves in package data


def test_a_local_file_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nemotron_h_tiny.yaml").write_text("name: local\n")
    assert resources.resolve_recipe("nemotron_h_tiny.yaml") == "nemotron_h_tiny.yaml"
    assert resources.resolve_recipe("nemotron_h_tiny") == str(resources.shipped_recipes()["nemotron_h_tiny"])


@pytest.mark.parametrize("spec", ["nemotron_h_huge", "recipes/nemotron_h_tiny.yaml", "sub/nemotron_h_tiny"])
def test_unknown_recipe_lists_the_shipped_names(tmp_path, monkeypatch, capsys, spec):
    monkeypatch.chdir(tmp_path)  # no recipes/ here: a path is never reinterpreted as a name
    with pytest.raises(BitdetInputError, match="shipped: nemotron3_nano, nemotron_h_8b, nemotron_h_tiny"):
        resources.resolve_recipe(spec)
    assert main(["recipe", "validate", spec]) == 2
    err = capsys.readouterr().err
    assert spec in err and "nemotron_h_tiny" in err and "Traceback" not in err


def test_metadata_version_is_the_code_version():
    assert importlib.metadata.version("megatron-bitdet") == megatron_bitdet.__version__
