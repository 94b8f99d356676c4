"""Regression checks for your own kernels, modules and runs, byte for byte (the pytest plugin in
:mod:`megatron_bitdet.testing.plugin` hands them out as fixtures)."""
from megatron_bitdet.testing.core import CheckReport, NondeterminismError
from megatron_bitdet.testing.e2e import RunsReport, check_end_to_end
from megatron_bitdet.testing.kernel import check_kernel
from megatron_bitdet.testing.module import Layout, check_module

__all__ = ["CheckReport", "Layout", "NondeterminismError", "RunsReport", "check_end_to_end", "check_kernel",
           "check_module"]
