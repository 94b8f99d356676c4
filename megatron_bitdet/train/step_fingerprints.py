"""What a training step's fingerprint line holds, taken from megatron's DDP buffers (the line's
format and writer: ``fingerprint.steps``)."""
from __future__ import annotations

from megatron_bitdet.fingerprint.tensor import state_digest


def ddp_buffers(ddp_modules, attr: str) -> list:
    """megatron DDP's contiguous ``param_data`` or ``grad_data`` buffers on this rank, dense then expert."""
    return [getattr(b, attr) for m in ddp_modules for b in (*m.buffers, *m.expert_parallel_buffers)]


def buffer_digest(ddp_modules, attr: str) -> str:
    """Digest of the rank's DDP buffers: one hash over a few large tensors, negligible next to a step."""
    return state_digest((f"buf{i}", t) for i, t in enumerate(ddp_buffers(ddp_modules, attr)))
