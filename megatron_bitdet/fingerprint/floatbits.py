"""Exact, decodable encodings of scalars: "<dtype>:<IEEE bits in hex>".

A rounded decimal can hide a low-bit difference; the bit pattern cannot.
"""
from __future__ import annotations

import struct

import torch

_INT_VIEW = {
    torch.float64: (torch.int64, 16),
    torch.float32: (torch.int32, 8),
    torch.bfloat16: (torch.int16, 4),
    torch.float16: (torch.int16, 4),
}
_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in _INT_VIEW}


def encode_float(value) -> str:
    """Encode a 0-d tensor in its own dtype, or a Python float as float64."""
    if isinstance(value, torch.Tensor):
        t = value.detach().reshape(()).cpu()
        if t.dtype not in _INT_VIEW:
            t = t.to(torch.float64)
        int_dtype, width = _INT_VIEW[t.dtype]
        bits = int(t.view(int_dtype).item()) & ((1 << (4 * width)) - 1)
        return f"{str(t.dtype).removeprefix('torch.')}:{bits:0{width}x}"
    bits = struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    return f"float64:{bits:016x}"


def decode_bits(encoded: str) -> tuple[str, int, int]:
    """Return (dtype name, integer bit pattern, bit width); ValueError on a malformed string."""
    name, _, hexbits = encoded.partition(":")
    if name not in _BY_NAME or not hexbits:
        raise ValueError(f"not an encoded float: {encoded!r}")
    width = _INT_VIEW[_BY_NAME[name]][1] * 4
    bits = int(hexbits, 16)
    if bits >> width:
        raise ValueError(f"bit pattern wider than {name}: {encoded!r}")
    return name, bits, width


def decode_float(encoded: str) -> float:
    """The encoded value as a Python float (exact for every supported dtype)."""
    name, bits, width = decode_bits(encoded)
    int_dtype = _INT_VIEW[_BY_NAME[name]][0]
    signed = bits - (1 << width) if bits >> (width - 1) else bits
    return torch.tensor(signed, dtype=int_dtype).view(_BY_NAME[name]).item()


def ulp_distance(a: str, b: str) -> int | None:
    """Distance in units of last place between two encodings of the same dtype (None if dtypes differ)."""
    na, ba, w = decode_bits(a)
    nb, bb, _ = decode_bits(b)
    if na != nb:
        return None

    def ordered(bits: int) -> int:  # map IEEE bits onto a monotonic integer line
        return -(bits & ((1 << (w - 1)) - 1)) if bits >> (w - 1) else bits

    return abs(ordered(ba) - ordered(bb))


def first_differing_bit(a: str, b: str) -> int | None:
    """Index (from the most significant bit, 0 = sign) of the first differing bit, None if equal."""
    _, ba, w = decode_bits(a)
    _, bb, _ = decode_bits(b)
    x = ba ^ bb
    return None if x == 0 else w - x.bit_length()
