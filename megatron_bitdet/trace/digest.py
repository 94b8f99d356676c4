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
_PREFIXES: dict = {}
_SPANS: dict = {}
_LAYOUTS: dict = {}
_STRIDED = torch.strided
_NODES = torch.utils._pytree.SUPPORTED_NODES
_xxh = xxhash.xxh3_64_hexdigest


def _host_buffer(t: torch.Tensor):
    """A zero-copy buffer over a contiguous CPU tensor's bytes."""
    return _span(t.data_ptr(), t.numel() * t.element_size())


def _span(ptr: int, n: int):
    """A ctypes array over ``n`` bytes at ``ptr``, kept per (ptr, n): it holds only the address, so a
    kept one reads whatever those bytes are when hashed (always a live tensor's)."""
    key = (ptr, n)
    buf = _SPANS.get(key)
    if buf is None:
        typ = _CHAR_ARRAYS.get(n)
        if typ is None:
            typ = _CHAR_ARRAYS[n] = ctypes.c_char * n
            if len(_CHAR_ARRAYS) > 4096:
                _CHAR_ARRAYS.clear()
        if len(_SPANS) > 65536:
            _SPANS.clear()
        buf = _SPANS[key] = typ.from_address(ptr)
    return buf


def release_spans() -> None:
    """Drop the kept byte spans (called when a traced step ends: thousands of ctypes objects would
    otherwise stay alive, and be walked by every full garbage collection, between traced steps)."""
    _SPANS.clear()


def prefix(t: torch.Tensor) -> str:
    key = (t.dtype, t.shape)
    p = _PREFIXES.get(key)
    if p is None:
        if len(_PREFIXES) > 65536:
            _PREFIXES.clear()
        p = _PREFIXES[key] = f"{dtype_name(t.dtype)}[{','.join(map(str, t.shape))}]:"
    return p


def fast(t: torch.Tensor):
    """``digest(t, "fast")``, the hot path of op tracing: for a contiguous CPU tensor a few attribute
    reads and one xxh3 call over its bytes; a permuted dense layout (a transpose) is recognised from
    its (shape, stride), cached, and hashed in memory order the same way."""
    p = _PREFIXES.get((t.dtype, t.shape)) or prefix(t)
    n = t.nbytes
    if not n:
        return p + "empty"
    if not t.is_cpu:
        return (p, pos_digest_tensor(t))
    tag = span_tag(t)
    if tag is not None:
        key = (t.data_ptr(), n)
        return p + tag + _xxh(_SPANS.get(key) or _span(*key))
    t, layout = _dense_view(t)
    return p + layout + _xxh(_host_buffer(t))


def span_tag(t: torch.Tensor) -> str | None:
    """What ``fast`` puts between prefix and hex when it hashes ``t``'s own memory span in memory order
    ("" contiguous, "s<strides>:" a permuted dense layout), or None when it hashes anything else (a
    gapped or broadcast view, a conjugate / negative view, a device tensor)."""
    if not t.is_cpu or t.is_conj() or t.is_neg():
        return None
    if t.is_contiguous():
        return ""
    shape, stride = t.shape, t.stride()
    tag = _LAYOUTS.get((shape, stride))
    return (_layout(shape, stride) if tag is None else tag) or None


def _layout(shape, stride) -> str:
    """The cached permuted-dense tag of a non-contiguous (shape, stride), "" when it has none."""
    if len(_LAYOUTS) > 65536:
        _LAYOUTS.clear()
    tag = _LAYOUTS[(shape, stride)] = "" if 0 in stride else _permuted_tag(shape, stride)
    return tag


def digest(t: torch.Tensor, mode: str):
    """A finished "dtype[shape]:hex" string, or (prefix, 0-d device tensor) to resolve at flush."""
    if mode == "fast":
        return fast(t)
    p = prefix(t)
    if t.numel() == 0:
        return p + "empty"
    if mode == "exact":
        return p + exact_digest(t)
    return p + hex64(torch.hash_tensor(hashable_view(t.detach())).item())


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
    tag = _permuted_tag(t.shape, t.stride())
    return (t, tag) if tag else (t.contiguous(), "")


def _permuted_tag(shape, stride) -> str:
    """"s<strides>:" when the dims of size > 1, ordered by stride, tile memory without gaps (a
    permutation of a contiguous layout: its span holds exactly the values); "" otherwise."""
    expected = 1
    for st, sz in sorted((st, sz) for st, sz in zip(stride, shape) if sz != 1):
        if st != expected:
            return ""
        expected *= sz
    return f"s{','.join(map(str, stride))}:"


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


def flat_tensors(args, kwargs) -> list[torch.Tensor]:
    """``trace_tensors((args, kwargs))`` without the pytree walk for the usual arguments (tensors,
    scalars and plain lists of them, e.g. sizes); other containers and registered pytree nodes still
    go through the pytree, so the result is the same list."""
    out = []
    for group in (args, kwargs.values() if kwargs else ()):
        for a in group:
            if isinstance(a, torch.Tensor):
                if a.layout is _STRIDED and not a.is_meta:
                    out.append(a)
            elif type(a) is list or type(a) is tuple:
                for x in a:
                    if isinstance(x, torch.Tensor):
                        if x.layout is _STRIDED and not x.is_meta:
                            out.append(x)
                    elif isinstance(x, (list, tuple, dict)) or type(x) in _NODES:
                        out += trace_tensors(x)
            elif isinstance(a, (list, tuple, dict)) or type(a) in _NODES:
                out += trace_tensors(a)
    return out


def trace_tensors(obj) -> list[torch.Tensor]:
    """Tensors inside any pytree of args / outputs (non-tensors and meta tensors ignored)."""
    return [x for x in torch.utils._pytree.tree_leaves(obj)
            if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.device.type != "meta"]
