"""Swapping torch.distributed collectives wherever megatron-core bound them.

Megatron binds some at import (``dist_all_gather_func = torch.distributed.all_gather_into_tensor``),
so replacing ``torch.distributed.f`` alone misses those callers; the tracer and the tax's
communication timer both go through ``swap_collectives``.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_bitdet.compat.rebind import megatron_modules, rebound


@contextmanager
def swap_collectives(wrap, names):
    """Replace the c10d functions ``names`` by ``wrap(name, fn)`` wherever they are bound —
    torch.distributed, c10d and megatron's import-time aliases — and restore them on exit.
    Yields the swapped bindings as ``"module:attr"`` strings."""
    replacements = {f: wrap(n, f) for n in names if (f := getattr(c10d, n, None)) is not None}
    with rebound(replacements, [dist, c10d, *megatron_modules()]) as changed:
        yield [f"{module.__name__}:{attr}" for module, attr, _ in changed]
