"""One supported-versions specifier, and docs/COMPAT.md names every version-sensitive site (read from the code)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from megatron_bitdet.compat.patching import load_declarations, parse_declaration
from megatron_bitdet.compat.versions import MEGATRON_CORE, describe, supports
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_bitdet"
DOC = ROOT / "docs" / "COMPAT.md"
SITE = re.compile(r"^\| `([^`]+)` \|", re.M)
VERSION_MENTION = re.compile(r"(?:megatron(?:[-_ ]core)?|mcore)\s*(?:[<>=!~]=?\s*)?\d+\.\d+", re.I)


def _listed() -> set[str]:
    return set(SITE.findall(DOC.read_text()))


def _imports_megatron(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "megatron" or n.startswith("megatron.") for n in names):
            return True
    return False


def test_pyproject_pin_and_the_document_are_the_specifier():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [Requirement(d) for d in deps if Requirement(d).name == "megatron-core"]
    assert [p.specifier for p in pins] == [MEGATRON_CORE]
    assert f"Supported megatron-core: `{describe()}`" in DOC.read_text()


def test_a_megatron_core_outside_the_range_is_refused_at_start(tmp_path):
    """A real distribution record of megatron-core 0.20.0 found first on the path: any command stops
    before it runs (exit 2), naming the version found and the range."""
    record = tmp_path / "megatron_core-0.20.0.dist-info"
    record.mkdir()
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.20.0\n")
    done = subprocess.run([sys.executable, "-m", "megatron_bitdet", "recipe", "validate", "nemotron_h_tiny"],
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "megatron-core 0.20.0 is installed; megatron-bitdet supports megatron-core >=0.16.1,<0.20" in done.stderr
    assert "Traceback" not in done.stderr


def test_builders_swap_the_module_in_either_shape():
    """A backend's experts builder: ``(module, submodules)`` before megatron-core 0.17, a partial after."""
    import functools

    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_bitdet.compat.builders import with_module
    from megatron_bitdet.kernels.grouped_mlp import GroupedProbMLP

    submodules = MLPSubmodules(linear_fc1=None, linear_fc2=None)
    assert with_module((SequentialMLP, submodules), GroupedProbMLP) == (GroupedProbMLP, submodules)
    built = with_module(functools.partial(SequentialMLP, submodules=submodules, name="experts"), GroupedProbMLP)
    assert (built.func, built.args, built.keywords) == (GroupedProbMLP, (), {"submodules": submodules, "name": "experts"})


def test_upstream_deterministic_mode_is_the_installed_versions_own(monkeypatch):
    """bench_tax_vs_upstream's upstream side: on megatron-core 0.19+ megatron's own
    ``training/determinism.py`` runs (it fills the canonical environment and asserts TP comm overlap
    off); before 0.19, the torch flag of Megatron-LM's validate_args block, nothing filled or asserted."""
    import torch

    from megatron_bitdet.compat import upstream_determinism

    names = ("NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "CUBLAS_WORKSPACE_CONFIG")
    for name in names:  # set, then removed: monkeypatch restores what was there, fills included
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    overlap = load_recipe("nemotron_h_tiny", ["parallel.tp_comm_overlap=true"])
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        if supports(version("megatron-core"), upstream_determinism.DETERMINISM_MODULE):
            assert "determinism.py" in upstream_determinism.source()
            with pytest.raises(AssertionError, match=r"tp_comm_overlap=False \(got True\)"):
                upstream_determinism.apply(overlap)
            upstream_determinism.apply(load_recipe("nemotron_h_tiny"))
            assert [os.environ.get(n) for n in names] == ["Ring", "0", ":4096:8"]
        else:
            assert "validate_args" in upstream_determinism.source()
            upstream_determinism.apply(overlap)
            assert [os.environ.get(n) for n in names] == [None] * 3
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)


def test_every_shipped_patch_reads_the_specifier():
    decls = load_declarations()
    assert decls and all(d.megatron_core == MEGATRON_CORE for d in decls)
    assert supports(version("megatron-core"))


def test_every_version_sensitive_module_is_listed():
    listed = _listed()
    sensitive = {str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
                 if VERSION_MENTION.search(p.read_text()) or _imports_megatron(p)}
    missing = sorted(sensitive - listed)
    assert not missing, f"docs/COMPAT.md does not list these modules that import or name megatron-core: {missing}"


def test_every_listed_site_exists():
    absent = [s for s in sorted(_listed()) if not list(ROOT.glob(s))]
    assert not absent, f"docs/COMPAT.md lists sites that do not exist: {absent}"


def test_patch_selection_is_read_from_the_declarations():
    """A declaration's ``needed_when`` decides, and a malformed one is refused naming the file."""
    base = {"id": "x", "rule": "r", "why": "w",
            "swaps": [{"replacement": "a.b:c", "targets": ["megatron.core.m:f"]}]}
    decl = parse_declaration({**base, "needed_when": [{"spec": "te", "layers": "E", "deterministic": False}]}, "x.yaml")
    recipe = load_recipe(str(ROOT / "recipes" / "nemotron_h_tiny.yaml"), ["determinism.mode=false"])
    assert decl.needed(recipe, "te") and not decl.needed(recipe, "local")
    assert not parse_declaration(base, "x.yaml").needed(recipe, "te")
    for bad, message in (([{"layer": "E"}], r"unknown key\(s\) \['layer'\]"), ([{"deterministic": "yes"}], "must be a bool"),
                         ({"spec": "te"}, "must be a list")):
        with pytest.raises(BitdetInputError, match=message) as err:
            parse_declaration({**base, "needed_when": bad}, "x.yaml")
        assert "x.yaml" in str(err.value)
