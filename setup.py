"""Packages: megatron_bitdet's own (namespace dirs included) plus the shipped data folders at the
repository top level, mapped to ``megatron_bitdet.recipes`` / ``.configs`` / ``.patches`` / ``.catalog`` so wheel
and editable installs both find them through ``megatron_bitdet.resources``. Metadata: pyproject.toml."""
from setuptools import find_namespace_packages, setup

SHIPPED = {f"megatron_bitdet.{kind}": kind for kind in ("recipes", "configs", "patches", "catalog")}

setup(
    packages=find_namespace_packages(include=["megatron_bitdet", "megatron_bitdet.*"],
                                     exclude=["*.__pycache__"]) + list(SHIPPED),
    package_dir=SHIPPED,
    package_data={**{name: ["*.yaml"] for name in SHIPPED}, "megatron_bitdet.trace.native": ["*.cpp"]},
)
