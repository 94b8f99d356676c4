"""What a training step's fingerprint line holds, taken from megatron's DDP buffers (the line's
format and writer: ``fingerprint.steps``)."""
from __future__ import annotations

from megatron_bitdet.fingerprint.tensor import state_digest


def ddp_buffers(ddp_modules, attr: str) -> list:
    """megatron DDP's contiguous ``param_data`` or ``grad_data`` buffers on this rank, dense then expert."""
    return [getattr(b, attr) for m in ddp_modules for b in (*m.buffers, *m.expert_parallel_buffers)]


def buffer_digest(ddp_modules, attr: str) -> str:
    """Digest of the rank's DDP buffers: one hash over a few large tensors, negligible next to a step.
    Without the distributed optimizer megatron allocates no ``param_data`` for 16-bit params: those
    buffers are digested as their params, in buffer order."""
    buffers = [b for m in ddp_modules for b in (*m.buffers, *m.expert_parallel_buffers)]
    return state_digest(item for i, b in enumerate(buffers)
                        for item in ([(f"buf{i}", getattr(b, attr))] if getattr(b, attr) is not None
                                     else [(f"buf{i}.{j}", p.detach()) for j, p in enumerate(b.params)]))
