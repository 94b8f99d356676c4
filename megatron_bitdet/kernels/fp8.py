"""Emulated FP8 (pure torch, any device): quantize to ``float8_e4m3fn`` / ``float8_e5m2`` with a
per-tensor scale or per-block (MXFP8-style, 32 elements, power-of-two) scales, dequantize, compute in
the input dtype. Where Transformer Engine cannot exist (CPU) this exercises the whole FP8 workflow:
encoded values and scales to fingerprint, delayed-scaling state to checkpoint and verify.

Rounding is torch's round-to-nearest-even cast after a clamp to the format's finite range (TE's
saturating cast); every op is elementwise or a max, so the result does not depend on threads.
"""
from __future__ import annotations

import torch

from megatron_bitdet.fingerprint.tensor import BlockedTensor

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MX_BLOCK = 32
# Roles of one linear's three quantized operands; rows of its amax history.
ROLES = ("input", "weight", "grad_output")


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = fp8_max(dtype)
    return x.clamp(-m, m).to(dtype)


def quantize_tensorwise(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Encoded values ``cast(x * scale)`` (scale: a 0-d float32 tensor)."""
    return _cast(x.float() * scale, dtype)


def dequantize_tensorwise(q: torch.Tensor, scale: torch.Tensor, like: torch.dtype) -> torch.Tensor:
    return (q.float() / scale).to(like)


def quantize_blockwise(x: torch.Tensor, dtype: torch.dtype, block: int = MX_BLOCK) -> BlockedTensor:
    """MXFP8-style: blocks of ``block`` along the last dim (zero-padded), one power-of-two scale each,
    stored as a biased exponent (E8M0: uint8, bias 127). The block's largest magnitude lands in the
    format's top binade, as in the OCP MX spec."""
    flat = x.float().reshape(-1, x.shape[-1])
    pad = -flat.shape[1] % block
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(flat.shape[0], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    _, exp = torch.frexp(amax)  # amax = m * 2**exp, m in [0.5, 1): floor(log2 amax) = exp - 1
    emax = int(torch.finfo(dtype).max).bit_length() - 1
    shared = torch.where(amax > 0, exp - 1 - emax, torch.zeros_like(exp)).clamp(-127, 127)
    values = _cast(torch.ldexp(blocks, -shared.float()), dtype)
    return BlockedTensor(values.view(flat.shape), (shared + 127).to(torch.uint8).view(flat.shape[0], -1),
                         format=f"mxfp8_{'e4m3' if dtype == torch.float8_e4m3fn else 'e5m2'}", block_size=block)


def dequantize_blockwise(bt: BlockedTensor, shape, like: torch.dtype) -> torch.Tensor:
    rows = bt.data.shape[0]
    blocks = bt.data.float().view(rows, -1, bt.block_size)
    shared = bt.scales.to(torch.int32).sub(127).view(rows, -1, 1).float()
    out = torch.ldexp(blocks, shared).view(rows, -1)[:, : shape[-1]]
    return out.reshape(shape).to(like)


def amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float()


def scale_from_history(history: torch.Tensor, dtype: torch.dtype, *, margin: int, algo: str) -> torch.Tensor:
    """TE's scaling rule: scale = fp8_max / amax / 2**margin, amax from the history (its max, or the
    most recent entry; current scaling passes a history of one); 1 while no amax has been seen."""
    a = history.amax() if algo == "max" else history[0]
    scale = torch.tensor(fp8_max(dtype), dtype=torch.float32) / a / (2.0 ** margin)
    return torch.where(a > 0, scale, torch.ones_like(scale))


class _QuantizeGradOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.fn(grad), None


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x.detach())

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize(x: torch.Tensor, fn) -> torch.Tensor:
    """Forward ``fn(x)`` (a quantize-dequantize); backward the gradient unchanged, as FP8 training
    takes the GEMM's gradient with respect to the high-precision operand."""
    return _StraightThrough.apply(x, fn)


def quantize_grad(x: torch.Tensor, fn) -> torch.Tensor:
    """Forward the identity; backward ``fn(grad)``: the output gradient enters the backward GEMMs
    quantize-dequantized (e5m2 in the hybrid format)."""
    return _QuantizeGradOutput.apply(x, fn)
