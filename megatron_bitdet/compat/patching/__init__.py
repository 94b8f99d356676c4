"""Deterministic swaps into megatron-core, declared as data in ``patches/*.yaml``.

``apply_patches(load_declarations())`` installs them (after a version check), ``revert_patches()``
undoes them, ``patched()`` does both around a block, ``applied_patches()`` lists them for the
manifest. On CPU, install ``megatron_bitdet.compat.cpu_backend`` first: some target modules (the Mamba
mixer) import GPU-only packages at import time.
"""
from megatron_bitdet.compat.patching.apply import (
    applied_patches,
    apply_patches,
    megatron_core_version,
    patched,
    revert_patches,
)
from megatron_bitdet.compat.patching.declaration import (
    PatchDeclaration,
    Swap,
    load_declaration,
    load_declarations,
    parse_declaration,
    split_symbol,
)

__all__ = [
    "PatchDeclaration",
    "Swap",
    "applied_patches",
    "apply_patches",
    "load_declaration",
    "load_declarations",
    "megatron_core_version",
    "parse_declaration",
    "patched",
    "revert_patches",
    "split_symbol",
]

from megatron_bitdet.compat.patching.select import (  # noqa: E402
    apply_for,
    declared_ids,
    install,
    select_patches,
    swap_patches,
)

__all__ += ["apply_for", "declared_ids", "install", "select_patches", "swap_patches"]
