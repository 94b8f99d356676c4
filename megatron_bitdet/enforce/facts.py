"""Environment facts the rules and late-application checks judge: package versions, env, process state.

A plain frozen dataclass so tests can state the facts of a configuration directly (the rule predicates
are the subject), while ``collect_facts`` reads the real ones without importing the GPU packages.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional

# distribution names (first found wins) for each package the rules or the scope care about
DISTRIBUTIONS = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core", "megatron_core"),
    "transformer-engine": ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    "mamba-ssm": ("mamba-ssm", "mamba_ssm"),
    "causal-conv1d": ("causal-conv1d", "causal_conv1d"),
    "triton": ("triton", "pytorch-triton"),
    "flash-attn": ("flash-attn", "flash_attn"),
    "fla": ("flash-linear-attention", "fla-core"),
    "apex": ("apex",),
    "numpy": ("numpy",),
}

# package -> (import name, the switch its sources must mention to have a deterministic path)
DETERMINISM_SWITCHES = {
    "mamba-ssm": ("mamba_ssm", "MAMBA_DETERMINISTIC"),
    "causal-conv1d": ("causal_conv1d", "CAUSAL_CONV1D_DETERMINISTIC"),
}

# modules whose presence in sys.modules means a library may already have read its environment
WATCHED_MODULES = ("transformer_engine", "mamba_ssm", "causal_conv1d", "torch._inductor.config", "triton")


@dataclass(frozen=True)
class Facts:
    env: Mapping[str, str] = field(default_factory=dict)  # effective determinism env after enforcement
    versions: Mapping[str, Optional[str]] = field(default_factory=dict)  # package -> version (None: absent)
    deterministic_support: Mapping[str, Optional[bool]] = field(default_factory=dict)
    cuda_initialized: bool = False
    dist_backend: Optional[str] = None  # backend of an existing default process group
    imported: frozenset = frozenset()   # WATCHED_MODULES already imported
    # rule id -> enforce.audit Findings of what will run at the positions that rule judges (a rule
    # listed here judges them instead of the recipe's flag); empty: nothing was audited
    runs: Mapping[str, tuple] = field(default_factory=dict)

    def has(self, package: str) -> bool:
        return self.versions.get(package) is not None


def _version(names) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _mentions(import_name: str, token: str) -> Optional[bool]:
    """Whether an installed package's Python sources mention ``token`` (None: not installed).
    find_spec on a top-level name locates it without running its (CUDA-loading) __init__."""
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for dirpath, _, files in os.walk(root):
            for name in files:
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as fh:
                        if token in fh.read():
                            return True
    return False


def package_versions() -> dict:
    return {pkg: _version(names) for pkg, names in DISTRIBUTIONS.items()}


def collect_facts(env: Mapping[str, str]) -> Facts:
    """The real facts of this process for the given effective environment."""
    import torch

    dist_backend = None
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        dist_backend = str(torch.distributed.get_backend())
    return Facts(
        env=dict(env),
        versions=package_versions(),
        deterministic_support={pkg: _mentions(mod, tok) for pkg, (mod, tok) in DETERMINISM_SWITCHES.items()},
        cuda_initialized=torch.cuda.is_available() and torch.cuda.is_initialized(),
        dist_backend=dist_backend,
        imported=frozenset(m for m in WATCHED_MODULES if m in sys.modules),
    )


def version_tuple(version: str) -> tuple:
    """'1.5.0.post8' -> (1, 5, 0): the numeric release prefix, for minimum-version rules."""
    out = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d+", part)
        if not digits:
            break
        out.append(int(digits.group()))
        if digits.group() != part:  # '0rc1': a pre/post-release tag ends the release number
            break
    return tuple(out)
