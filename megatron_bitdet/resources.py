"""The shipped recipes, configs and patch declarations, found through the installed package.

They live at the repository top level (``recipes/``, ``configs/``, ``patches/``) and install as the
packages ``megatron_bitdet.recipes`` / ``.configs`` / ``.patches`` (a package-dir mapping in
setup.py), so a wheel and an editable install resolve them the same way and nothing depends on the
current directory or on a source checkout.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Dict

from megatron_bitdet.errors import BitdetInputError

KINDS = ("recipes", "configs", "patches")


def shipped_dir(kind: str) -> Path:
    """The installed directory of one kind of shipped data."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of shipped data {kind!r}; known: {KINDS}")
    try:
        root = resources.files(f"megatron_bitdet.{kind}")
    except ModuleNotFoundError:
        raise BitdetInputError(f"megatron_bitdet.{kind} is not installed (an install older than the package-data "
                               "layout?): reinstall megatron-bitdet (pip install -e . / make install)") from None
    if not isinstance(root, Path) or not root.is_dir():
        raise BitdetInputError(f"megatron_bitdet.{kind} is not a directory on disk ({root}); "
                               "install megatron-bitdet unzipped (pip does)")
    return root


def shipped_recipes() -> Dict[str, Path]:
    """Shipped recipe name (file stem) -> file."""
    return {p.stem: p for p in sorted(shipped_dir("recipes").glob("*.yaml"))}


def resolve_recipe(spec) -> str:
    """A recipe argument as a file path: an existing file wins; otherwise a bare name (with or without
    ``.yaml``) names a shipped recipe. Anything else is refused with the shipped names listed."""
    spec = os.fspath(spec)
    if os.path.isfile(spec):
        return spec
    shipped = shipped_recipes()
    name = spec[:-len(".yaml")] if spec.endswith(".yaml") else spec
    if os.sep not in spec and "/" not in spec and name in shipped:
        return str(shipped[name])
    raise BitdetInputError(f"{spec}: cannot read recipe: no such file, and no shipped recipe of that name; "
                           f"shipped: {', '.join(shipped)}")
