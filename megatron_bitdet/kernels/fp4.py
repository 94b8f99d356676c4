"""Emulated NVFP4 (pure torch, any device), after NVIDIA's training recipe: "Pretraining Large Language
Models with NVFP4", NVIDIA 2025, arXiv 2509.25149. Where Transformer Engine's ``NVFP4BlockScaling``
cannot run (CPU, pre-Blackwell GPUs) this exercises the whole FP4 workflow: packed encoded values and
both scale levels to fingerprint, and the recipe's run state (stochastic-rounding generator, Hadamard
signs) to checkpoint, restore and verify.

The format: E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), two per byte in
``torch.float4_e2m1fn_x2`` (the first element in the low nibble); one E4M3 decode scale per block of
16 elements (1x16, or 16x16 for weights: the recipe's 2D scaling, so forward and backward see the same
quantized weight); one fp32 per-tensor scale ``s_enc = 6 * 448 / amax`` mapping the tensor's largest
block scale onto E4M3's top. Rounding is to nearest, ties to even, except where a generator is given
(the recipe rounds gradients stochastically). Encoding is elementwise or a max, and stochastic rounding
draws only from the generator it is given: the same input and generator state give the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
BLOCK = 16
_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes by code (exponent, mantissa bits)


@dataclass(frozen=True)
class NVFP4Tensor:
    """Encoded values (packed ``float4_e2m1fn_x2``, padded to whole blocks), E4M3 block scales (one per
    ``block`` = (rows, cols) tile), the fp32 per-tensor scale, and the unpadded shape."""

    values: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, int]
    block: tuple[int, int]


def _grid(device) -> torch.Tensor:
    return torch.tensor(_GRID, dtype=torch.float32, device=device)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    f = x.float()
    return torch.nn.functional.pad(f, (0, -f.shape[1] % cols, 0, -f.shape[0] % rows))


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor encode scale: the largest block decode scale (amax / 6) lands on E4M3's 448."""
    top = torch.full_like(amax, E2M1_MAX * E4M3_MAX)  # tensor / tensor: a true division, not x * (1/amax)
    return torch.where(amax > 0, top / amax, torch.ones_like(amax))


def e2m1_codes(v: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """4-bit codes (sign in bit 3) of ``v`` (already scaled into [-6, 6]): nearest-even, or stochastic
    with ``generator`` (up with probability equal to the distance from the lower grid point)."""
    grid = _grid(v.device)
    a = v.abs().clamp(max=E2M1_MAX)
    lo = (torch.searchsorted(grid, a, right=True) - 1).clamp(max=len(_GRID) - 2)
    below, above = grid[lo], grid[lo + 1]
    if generator is None:
        d_lo, d_hi = a - below, above - a
        up = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    else:
        u = torch.rand(a.shape, generator=generator, device=a.device)
        up = u < (a - below) / (above - below)
    return ((lo + up.to(lo.dtype)) | torch.where(v < 0, 8, 0)).to(torch.uint8)


def pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.float4_e2m1fn_x2)


def unpack(values: torch.Tensor) -> torch.Tensor:
    b = values.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], -1)


def quantize(x: torch.Tensor, *, block: tuple[int, int] = (1, BLOCK),
             generator: torch.Generator | None = None) -> NVFP4Tensor:
    """NVFP4 encoding of a 2-D tensor in ``block`` tiles along its last dim (zero-padded)."""
    br, bc = block
    f = _padded(x, br, bc)
    rows, cols = f.shape
    amax = f.abs().amax()
    s_enc = global_scale(amax)
    tiles = f.view(rows // br, br, cols // bc, bc)
    block_amax = tiles.abs().amax(dim=(1, 3))
    scales = (block_amax / E2M1_MAX * s_enc).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    decode = (scales.float() / s_enc)[:, None, :, None]
    v = torch.where(decode > 0, tiles / decode, torch.zeros_like(tiles)).view(rows, cols)
    return NVFP4Tensor(pack(e2m1_codes(v, generator)), scales, s_enc, tuple(x.shape), block)


def dequantize(t: NVFP4Tensor, like: torch.dtype, *, trim: bool = True) -> torch.Tensor:
    """The encoded values times both scales, in ``like``; ``trim``: without the padding."""
    codes = unpack(t.values)
    mags = _grid(codes.device)[(codes & 7).long()]
    vals = torch.where(codes >= 8, -mags, mags)
    br, bc = t.block
    rows, cols = vals.shape
    decode = (t.block_scales.float() / t.global_scale)[:, None, :, None]
    out = (vals.view(rows // br, br, cols // bc, bc) * decode).view(rows, cols)
    return (out[: t.shape[0], : t.shape[1]] if trim else out).to(like)


def hadamard_matrix(signs: torch.Tensor) -> torch.Tensor:
    """``diag(signs) H16 / 4``: orthogonal (its transpose is its inverse), entries +-1/4 (exact)."""
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return signs.float()[:, None] * h.to(signs.device) / 4


def random_hadamard(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The recipe's random Hadamard transform along the last dim, per 16-element block (zero-padded,
    padding kept: the transformed padding is not zero, and A H (B H)^T = A B^T needs all of it)."""
    f = _padded(x, 1, BLOCK)
    return (f.view(f.shape[0], -1, BLOCK) @ hadamard_matrix(signs)).view(f.shape)


def draw_signs(generator: torch.Generator) -> torch.Tensor:
    """A random +-1 vector of the transform's size."""
    return torch.randint(0, 2, (BLOCK,), generator=generator).float() * 2 - 1
