"""The pytest plugin (entry point ``pytest11: bitdet``), active wherever megatron-bitdet is installed.

Fixtures hand out the checks of :mod:`megatron_bitdet.testing`; the module and end-to-end ones write
under the test's ``tmp_path``. Importing this module loads nothing heavy (no torch, no megatron):
every pytest session in the environment imports it.
"""
from __future__ import annotations

import functools

import pytest


def pytest_report_header(config):
    from importlib.metadata import version

    return (f"bitdet: megatron-bitdet {version('megatron-bitdet')} "
            "(fixtures bitdet_kernel_check, bitdet_module_check, bitdet_e2e_check)")


@pytest.fixture
def bitdet_kernel_check():
    """``check_kernel(fn, *inputs, repeats=5, threads=None, ...)``: repeat with identical inputs and RNG."""
    from megatron_bitdet.testing import check_kernel

    return check_kernel


@pytest.fixture
def bitdet_module_check(tmp_path):
    """``check_module(builder, layouts=..., world_size=2, ...)``: spawned megatron ranks, RNG restored."""
    from megatron_bitdet.testing import check_module

    return functools.partial(check_module, workdir=tmp_path / "bitdet_module_check")


@pytest.fixture
def bitdet_e2e_check(tmp_path):
    """``check_end_to_end(recipe, overrides, nproc=2, steps=3, ...)``: two runs + bitdet compare."""
    from megatron_bitdet.testing import check_end_to_end

    return functools.partial(check_end_to_end, workdir=tmp_path / "bitdet_e2e_check")
