"""Megatron's own deterministic mode as the installed megatron-core runs it: the side bitdet's recipe is
measured against (``benchmarks/bench_tax_vs_upstream.py``, ``gpu_check.py``'s "bitdet vs upstream" row).
Both sides build megatron-core with ``TransformerConfig.deterministic_mode`` from the recipe; this is what
Megatron-LM's ``--deterministic-mode`` does to the process on top of it.

- megatron-core 0.19+ ships ``megatron/training/determinism.py``, whose ``apply_determinism_to_args``
  Megatron-LM's ``validate_args`` calls: cross-entropy fusion and TP comm overlap asserted off,
  ``NCCL_ALGO`` / ``NVTE_ALLOW_NONDETERMINISTIC_ALGO`` / ``CUBLAS_WORKSPACE_CONFIG`` /
  ``MAMBA_DETERMINISTIC`` validated and the canonical values filled in, then torch's deterministic
  algorithms on. It is called as is, on the recipe's two flags.
- before 0.19 ``validate_args`` does it inline (flash attention and cross-entropy fusion asserted off,
  ``NCCL_ALGO`` required, then ``torch.use_deterministic_algorithms(True)``): nothing to call, so the
  flag it sets is set (bitdet's rules refuse what those asserts refuse).

Neither touches torch's ``fill_uninitialized_memory``: its default (on) stays, as under Megatron-LM.

Importing ``megatron.training`` (0.19's wheel ships it) runs Megatron-LM's ``training.py``, whose module-level
``logging.basicConfig`` sends every INFO record to stdout: that is Megatron-LM's launch logging, not its
deterministic mode, so the root logger is left as it was (else megatron-core's INFO lines, per model build and
DDP bucket, land in the measuring process's stdout: ``gpu_check.py``'s table).
"""
from __future__ import annotations

import functools
import logging
from argparse import Namespace

import torch
from packaging.specifiers import SpecifierSet

from megatron_bitdet.compat.versions import megatron_core_version, supports

DETERMINISM_MODULE = SpecifierSet(">=0.19")  # megatron/training/determinism.py (read in 0.18.2 / 0.19.2)


@functools.lru_cache(maxsize=1)
def _has_module() -> bool:
    return supports(megatron_core_version(), DETERMINISM_MODULE)


def source() -> str:
    """Which upstream mode :func:`apply` puts in place here, for the measurement's report."""
    where = ("megatron/training/determinism.py: apply_determinism_to_args" if _has_module() else
             "Megatron-LM validate_args' --deterministic-mode block: torch.use_deterministic_algorithms(True)")
    return f"megatron-core {megatron_core_version()}'s {where}"


def apply(recipe) -> None:
    """Put this process in upstream's deterministic mode for a run of ``recipe`` (cheap: once a step)."""
    if not _has_module():
        torch.use_deterministic_algorithms(True)
        return
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        from megatron.training.determinism import apply_determinism_to_args
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    apply_determinism_to_args(Namespace(cross_entropy_loss_fusion=recipe.model.cross_entropy_loss_fusion,
                                        tp_comm_overlap=recipe.parallel.tp_comm_overlap))
