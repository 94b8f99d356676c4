"""Logical digests: a digest of named tensors that does not depend on how their elements are laid out
or split over ranks (``dp_invariant`` runs of different data-parallel sizes are compared by these).

Each element contributes ``mix(key(name) + index * K1 + bits(value) * K2)`` and the contributions are
added modulo 2**64. Addition is associative and commutative, so any partition of the elements over
ranks, buffers, buckets or shards gives the same total: each rank adds the elements it holds (on their
device, no host copy), and the reader adds the ranks' partials (:func:`combine_partials`). The key
carries the parameter's name (and whatever else the caller puts in it, e.g. its model-parallel
coordinates); the index is the element's position in the logical (row-major) tensor, so moving a value
to another element, or to another tensor, changes the digest. Like any 64-bit checksum it can collide;
it is no cryptographic hash.
"""
from __future__ import annotations

import xxhash

ALGO = "lsum64"
_MASK = (1 << 64) - 1
_K2 = 0xC2B2AE3D27D4EB4F  # the bits' multiplier (the index's is tensor's golden ratio, the finalizer splitmix64's)


def _signed(x: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    x &= _MASK
    return x - (1 << 64) if x >> 63 else x


def name_key(name: str) -> int:
    """The per-tensor key (int64 bit pattern) of a name."""
    return _signed(xxhash.xxh3_64_intdigest(name.encode()))


def _bits(flat):
    """The elements' exact bit patterns, widened to int64."""
    import torch

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.uint8}[flat.element_size()]
    return flat.view(ints).to(torch.int64) if flat.is_floating_point() else flat.to(torch.int64)


def partial_sum(flat, key: int, offset: int):
    """This piece's contribution: ``flat`` holds the logical elements ``offset ..`` of the tensor
    keyed ``key``. A 0-d int64 tensor on ``flat``'s device (nothing is read back here)."""
    import torch

    from megatron_bitdet.fingerprint.tensor import _GOLDEN, _mix_

    idx = torch.arange(offset, offset + flat.numel(), dtype=torch.int64, device=flat.device)
    h = idx * _GOLDEN + _bits(flat.reshape(-1)) * _signed(_K2) + key
    _mix_(h, torch.empty_like(h))
    return h.sum()


def encode(total: int) -> str:
    return f"{ALGO}:{total & _MASK:016x}"


def combine_partials(partials) -> str:
    """The logical digest of the whole: the ranks' partial digests (``lsum64:<hex>``) added mod 2**64."""
    total = 0
    for p in partials:
        algo, _, hexed = p.partition(":")
        if algo != ALGO:
            raise ValueError(f"not a {ALGO} digest: {p!r}")
        total += int(hexed, 16)
    return encode(total)
