"""Install the recipe's reduction mode for the rest of the process (``determinism.reductions``).

c10d's float reductions are rebound wherever they are bound — torch.distributed, c10d and megatron's
import-time aliases (``dist_reduce_scatter_func``) — through the same swap the tracer uses, so DDP's
bucket all-reduce / distributed-optimizer reduce-scatter, the TP/SP mappings and the scalar
all-reduces (loss, grad norm) all go through :mod:`megatron_bitdet.kernels.reductions`.
"""
from __future__ import annotations

import contextlib
import os

from megatron_bitdet.enforce.env import EMULATED_RING_ENV
from megatron_bitdet.kernels import reductions as kernels

MODES = ("native", "topology_invariant")
_INSTALLED = contextlib.ExitStack()
_RECORD: dict = {}


@contextlib.contextmanager
def active(mode: str):
    """``mode``'s reductions for a block only (the tax alternates sides with and without them);
    yields the swapped bindings ([] when c10d's reductions stay)."""
    from megatron_bitdet.compat.collectives import swap_collectives

    reductions = kernels.from_environment(mode)
    if reductions is None:
        yield []
        return
    makers = kernels.wrappers(reductions)
    with swap_collectives(lambda name, fn: makers[name](fn), tuple(makers)) as bindings:
        yield bindings


def install(mode: str) -> dict | None:
    """Install once per process; returns the manifest record (None when c10d's reductions stay)."""
    if _RECORD:
        return dict(_RECORD)
    reductions = kernels.from_environment(mode)
    if reductions is None:
        return None
    bindings = _INSTALLED.enter_context(active(mode))
    _RECORD.update(
        id="topology_invariant_reductions" if mode == "topology_invariant" else "emulated_ring_reductions",
        mode=mode, transport=type(reductions.transport).__name__,
        emulated_ring_seed=os.environ.get(EMULATED_RING_ENV), bindings=sorted(bindings),
    )
    return dict(_RECORD)
