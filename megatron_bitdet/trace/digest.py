"""Per-tensor digests for trace records: cheap, position-sensitive, and sync-free on accelerators.

CPU tensors are hashed in place with xxh3_64 over their bytes (no torch op, no copy when contiguous:
faster than any torch-op digest on the host). Accelerator tensors get the on-device pos64 digest;
its 0-d result stays on the device until the record batch is flushed, so tracing adds no per-op sync.
"""
from __future__ import annotations

import ctypes

import torch
import xxhash

from megatron_bitdet.fingerprint.tensor import dtype_name, exact_digest, hashable_view, hex64, pos_digest_tensor

HASHES = ("fast", "exact", "xor")
_CHAR_ARRAYS: dict[int, type] = {}


def _host_buffer(t: torch.Tensor):
    """A zero-copy buffer over a contiguous CPU tensor's bytes."""
    n = t.numel() * t.element_size()
    typ = _CHAR_ARRAYS.get(n)
    if typ is None:
        typ = _CHAR_ARRAYS[n] = ctypes.c_char * n
        if len(_CHAR_ARRAYS) > 4096:
            _CHAR_ARRAYS.clear()
    return typ.from_address(t.data_ptr())


def prefix(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)}[{','.join(map(str, t.shape))}]:"


def digest(t: torch.Tensor, mode: str):
    """A finished "dtype[shape]:hex" string, or (prefix, 0-d device tensor) to resolve at flush."""
    p = prefix(t)
    if t.numel() == 0:
        return p + "empty"
    if mode == "exact":
        return p + exact_digest(t)
    if mode == "xor":
        return p + hex64(torch.hash_tensor(hashable_view(t.detach())).item())
    if t.device.type == "cpu":
        t, layout = _dense_view(t)
        return p + layout + f"{xxhash.xxh3_64_intdigest(_host_buffer(t)):016x}"
    return (p, pos_digest_tensor(t))


def _dense_view(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A tensor whose memory span holds exactly its values, plus a layout tag when not contiguous.

    Broadcast (stride-0) dims are hashed once, permuted dense layouts (transposes) in memory order:
    both are exact and avoid materialising a copy; anything else with gaps is made contiguous.
    """
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.is_contiguous():
        return t, ""
    if 0 in t.stride():
        t = t.as_strided([1 if st == 0 else sz for sz, st in zip(t.shape, t.stride())], t.stride())
    expected = 1
    for st, sz in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if st != expected:
            return t.contiguous(), ""
        expected *= sz
    return t, f"s{','.join(map(str, t.stride()))}:"


def resolve(items: list) -> None:
    """Replace every pending (prefix, device tensor) in the given lists by its string, one sync per device."""
    pending = [(lst, i) for lst in items for i, v in enumerate(lst) if isinstance(v, tuple)]
    if not pending:
        return
    by_dev: dict = {}
    for lst, i in pending:
        by_dev.setdefault(lst[i][1].device, []).append((lst, i))
    for entries in by_dev.values():
        values = torch.stack([lst[i][1] for lst, i in entries]).cpu().tolist()
        for (lst, i), v in zip(entries, values):
            lst[i] = lst[i][0] + hex64(v)


def trace_tensors(obj) -> list[torch.Tensor]:
    """Tensors inside any pytree of args / outputs (non-tensors and meta tensors ignored)."""
    return [x for x in torch.utils._pytree.tree_leaves(obj)
            if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.device.type != "meta"]
