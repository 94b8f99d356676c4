"""megatron-core's scratch memory, reached through its private global (no public accessor in 0.16)."""
from __future__ import annotations


def scratch_buffers() -> list:
    """The tensors of megatron's global memory buffer (``parallel_state._GLOBAL_MEMORY_BUFFER``):
    scratch whose contents at a step's start mean nothing; empty before it exists."""
    from megatron.core import parallel_state as ps

    buffer = ps._GLOBAL_MEMORY_BUFFER
    return list(buffer.buffer.values()) if buffer is not None else []
