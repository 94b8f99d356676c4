"""Tensor fingerprints: metadata + XOR hash + position-sensitive device digest + exact bytes digest.

`torch.hash_tensor` is an XOR reduction: it cannot see permutations and equal pairs cancel, so every
fingerprint also carries an order-aware digest computed *on the tensor's device* with plain torch
integer ops (no host copy), and optionally an exact xxh3_128 of the bytes for confirmation.

Position-sensitive digest ("pos64"): the bytes are read as 64-bit words w_i laid out as rows of
`_ROW_WORDS`; each word is multiplied by an odd constant, keyed by its column (+ key_j), passed
through a xorshift and summed per row (integer addition mod 2^64 is associative, so the result does not depend on reduction
order or thread count); the row sums are then mixed with their row keys and summed again.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import xxhash

_MASK64 = (1 << 64) - 1
_ROW_WORDS = 8192            # words per row of the flat layout
_BLOCK_WORDS = 64 * 8192     # words per cache-sized block (4 MiB of int64)


def _s64(v: int) -> int:
    """A uint64 constant as the int64 torch needs for wrapping multiplication."""
    v &= _MASK64
    return v - (1 << 64) if v >> 63 else v


_GOLDEN = _s64(0x9E3779B97F4A7C15)
_MIX1 = _s64(0xBF58476D1CE4E5B9)
_MIX2 = _s64(0x94D049BB133111EB)
_KEYS: dict[tuple[int, str], torch.Tensor] = {}


def _shr(t: torch.Tensor, s: int, out: torch.Tensor) -> torch.Tensor:
    """Logical right shift on int64 (torch shifts arithmetically; mask off the sign fill)."""
    torch.bitwise_right_shift(t, s, out=out)
    return out.bitwise_and_((1 << (64 - s)) - 1)


def _mix_(t: torch.Tensor, tmp: torch.Tensor) -> None:
    """In-place splitmix64 finalizer (vectorised)."""
    t.bitwise_xor_(_shr(t, 30, tmp)).mul_(_MIX1)
    t.bitwise_xor_(_shr(t, 27, tmp)).mul_(_MIX2)
    t.bitwise_xor_(_shr(t, 31, tmp))


def _keys(width: int, device: torch.device) -> torch.Tensor:
    """Per-column keys (mixed golden-ratio sequence), cached per (width, device)."""
    key = (width, str(device))
    k = _KEYS.get(key)
    if k is None:
        k = torch.arange(1, width + 1, dtype=torch.int64, device=device).mul_(_GOLDEN)
        _mix_(k, torch.empty_like(k))
        if len(_KEYS) > 64:
            _KEYS.clear()
        _KEYS[key] = k
    return k


def _row_sums(m: torch.Tensor) -> torch.Tensor:
    """sum_j g(C * m[r, j] + key_j) for every row r, g(u) = u ^ (u >>> 29), in cache-sized row blocks.

    Four elementwise passes per word (the fold of a fused multiply-add, one xorshift, the sum) keep
    it at memcpy-class speed; per word the map is a bijection, and the keyed xorshift makes the sum
    order-aware (a sum of a Z/2^64-linear map would not be)."""
    rows, width = m.shape
    out = torch.empty(rows, dtype=torch.int64, device=m.device)
    keys = _keys(width, m.device)
    step = max(1, _BLOCK_WORDS // max(width, 1))
    t = torch.empty(min(step, rows), width, dtype=torch.int64, device=m.device)
    tmp = torch.empty_like(t)
    for r0 in range(0, rows, step):
        blk = m[r0:r0 + step]
        tt, uu = t[: blk.shape[0]], tmp[: blk.shape[0]]
        torch.add(keys, blk, alpha=_MIX1, out=tt)
        tt.bitwise_xor_(_shr(tt, 29, uu))
        torch.sum(tt, dim=1, out=out[r0:r0 + blk.shape[0]])
    return out


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous()


def _flat_words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor's bytes as int64 words (zero-copy when aligned) and the byte count."""
    b = _contig(t).reshape(-1).view(torch.uint8)
    n = b.numel()
    whole = n // 8 * 8
    if b.storage_offset() % 8:
        b = b.clone()
    words = b[:whole].view(torch.int64)
    if whole != n:
        pad = torch.zeros(8, dtype=torch.uint8, device=b.device)
        pad[: n - whole] = b[whole:]
        words = torch.cat([words, pad.view(torch.int64)])
    return words, n


def _row_words(t: torch.Tensor) -> torch.Tensor:
    """A (rows, words) int64 matrix of each dim-0 slice; rows whose bytes are not 8-aligned are widened."""
    c = _contig(t).reshape(t.shape[0], -1) if t.dim() else _contig(t).reshape(1, 1)
    itemsize = c.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if c.shape[1] * itemsize % 8 == 0 and c.storage_offset() * itemsize % 8 == 0:
        return c.view(torch.uint8).view(torch.int64)
    return c.view(ints[itemsize]).to(torch.int64)


def _finish(parts: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Fold a vector of partial digests and the byte length into one 0-d int64 digest."""
    tail = torch.tensor([nbytes], dtype=torch.int64, device=parts.device)
    return _row_sums(torch.cat([parts, tail]).view(1, -1))[0]


def pos_digest_tensor(t: torch.Tensor) -> torch.Tensor:
    """Position-sensitive digest as a 0-d int64 tensor on t's device (no host sync; resolve later)."""
    words, nbytes = _flat_words(t)
    full = words.numel() // _ROW_WORDS * _ROW_WORDS
    parts = [_row_sums(words[:full].view(-1, _ROW_WORDS))] if full else []
    if full != words.numel():
        parts.append(_row_sums(words[full:].view(1, -1)))
    return _finish(torch.cat(parts) if parts else words, nbytes)


def hex64(d: torch.Tensor | int) -> str:
    """A digest (0-d tensor or int) as 16 lowercase hex digits."""
    return f"{int(d) & _MASK64:016x}"


def pos_digest(t: torch.Tensor) -> str:
    return hex64(pos_digest_tensor(t).item())


def row_digests(t: torch.Tensor) -> list[str]:
    """One position-sensitive digest per dim-0 row (routing maps, MoE dispatch buffers)."""
    if t.dim() == 0 or t.shape[0] == 0:
        return []
    m = _row_words(t)
    sums = _row_sums(m)
    _mix_(sums, torch.empty_like(sums))
    return [hex64(v) for v in sums.cpu().tolist()]


def chunk_digests(t: torch.Tensor, chunks: int) -> list[str]:
    """Digests of `chunks` near-equal contiguous pieces of the flattened tensor."""
    flat = _contig(t).reshape(-1)
    return [pos_digest(c) for c in torch.tensor_split(flat, chunks)]


def hashable_view(t: torch.Tensor) -> torch.Tensor:
    """float8 / bool / complex as same-width integers (hash_tensor does not take them everywhere)."""
    if t.is_floating_point() and t.element_size() == 1 or t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        return torch.view_as_real(t)
    return t


def xor_digest(t: torch.Tensor) -> str | None:
    """torch.hash_tensor (XOR of 64-bit widened elements); None where torch has no kernel."""
    if not hasattr(torch, "hash_tensor") or t.numel() == 0:
        return None
    try:
        return hex64(torch.hash_tensor(hashable_view(t.detach())).item())
    except (NotImplementedError, RuntimeError):
        return None


def _host_bytes(t: torch.Tensor) -> memoryview:
    c = _contig(t).reshape(-1).view(torch.uint8)
    return memoryview(c.cpu().numpy())


def exact_digest(t: torch.Tensor) -> str:
    """xxh3_128 of the tensor's contiguous bytes (copies to host for device tensors)."""
    return xxhash.xxh3_128_hexdigest(_host_bytes(t))


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


@dataclass(frozen=True)
class FingerprintConfig:
    """Which digests a fingerprint carries (the position-sensitive one is always there)."""

    xor: bool = True
    exact: bool = False
    rows: bool = False
    chunks: int = 0


@dataclass(frozen=True)
class TensorFingerprint:
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int
    pos: str
    xor: str | None = None
    exact: str | None = None
    rows: tuple[str, ...] | None = None
    chunks: tuple[str, ...] | None = None

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> "TensorFingerprint":
        tup = {k: tuple(d[k]) for k in ("shape", "stride", "rows", "chunks") if d.get(k) is not None}
        return cls(**{**d, **tup})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    def differing_rows(self, other: "TensorFingerprint") -> list[int]:
        """Indices of dim-0 rows whose digests differ (needs rows=True on both)."""
        return [i for i, (a, b) in enumerate(zip(self.rows or (), other.rows or ())) if a != b]


def fingerprint(t: torch.Tensor, config: FingerprintConfig = FingerprintConfig()) -> TensorFingerprint:
    """Fingerprint one tensor: metadata always; digests as configured."""
    return TensorFingerprint(
        dtype=dtype_name(t.dtype),
        shape=tuple(t.shape),
        stride=tuple(t.stride()),
        numel=t.numel(),
        pos=pos_digest(t),
        xor=xor_digest(t) if config.xor else None,
        exact=exact_digest(t) if config.exact else None,
        rows=tuple(row_digests(t)) if config.rows else None,
        chunks=tuple(chunk_digests(t, config.chunks)) if config.chunks else None,
    )


@dataclass(frozen=True)
class BlockedTensor:
    """An MXFP8 / NVFP4-style tensor: encoded values plus per-block scales."""

    data: torch.Tensor
    scales: torch.Tensor
    format: str = "mxfp8"
    block_size: int = 32


@dataclass(frozen=True)
class BlockedFingerprint:
    format: str
    block_size: int
    values: TensorFingerprint
    scales: TensorFingerprint

    def to_json(self) -> dict:
        return {"format": self.format, "block_size": self.block_size,
                "values": self.values.to_json(), "scales": self.scales.to_json()}

    def differs_in(self, other: "BlockedFingerprint") -> list[str]:
        """Which parts differ: a subset of ["values", "scales"]."""
        return [p for p in ("values", "scales") if getattr(self, p) != getattr(other, p)]


def fingerprint_blocked(bt: BlockedTensor, config: FingerprintConfig = FingerprintConfig()) -> BlockedFingerprint:
    return BlockedFingerprint(bt.format, bt.block_size, fingerprint(bt.data, config), fingerprint(bt.scales, config))
