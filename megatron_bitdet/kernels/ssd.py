"""Mamba-2 SSD chunked scan in plain torch: a deterministic swap-in for mamba_ssm's Triton kernels.

mamba_ssm's Triton backward accumulates dx/dB/dC/ddt with atomic adds and its cumsums depend on the
autotuned block size, so its bits vary run to run. Here every step is a fixed-shape torch op (cumsum,
exp, batched matmul, reductions), whose CPU kernels give the same bits for the same inputs and thread
count, and autograd provides the backward. The algorithm is the "minimal discrete" SSD of the Mamba-2
paper: quadratic attention-like form inside each chunk, a segment-sum decay matrix across chunks (no
Python loop over time or over chunks).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_bitdet.errors import BitdetError, BitdetInputError


class UnsupportedKernelFeature(BitdetError, NotImplementedError):
    """A kernel argument this pure-torch path does not implement (refused rather than ignored)."""


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise BitdetInputError(message)


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[j+1] + ... + a[i] for i >= j, else -inf; summed directly, never as a
    difference of two cumulative sums, so exp() of it is stable and exactly 1 on the diagonal."""
    t = a.size(-1)
    strict = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    s = a.unsqueeze(-1).expand(*a.shape, t).masked_fill(~strict, 0).cumsum(dim=-2)
    return s.masked_fill(~torch.ones_like(strict).tril(0), -math.inf)


def _discretize_dt(dt, dt_bias, dt_softplus, dt_limit):
    """dt + bias, softplus (threshold 20, as mamba_ssm), then always the clamp to dt_limit: mamba_ssm's
    chunk-cumsum kernel clamps at the default (0, inf) too, so a negative dt without softplus is 0."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _pad_seq(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Zero-pad dim 1 (the sequence) at the end."""
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t


def _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states):
    _expect(x.dim() == 4, f"x must be (batch, seqlen, nheads, headdim), got {tuple(x.shape)}")
    b, l, h, p = x.shape
    _expect(B.dim() == 4 and B.shape[:2] == (b, l), f"B must be (batch, seqlen, ngroups, dstate), got {tuple(B.shape)}")
    g, n = B.shape[2:]
    _expect(h % g == 0, f"nheads ({h}) must be divisible by ngroups ({g})")
    _expect(C.shape == B.shape, f"C {tuple(C.shape)} must match B {tuple(B.shape)}")
    _expect(dt.shape == (b, l, h), f"dt must be {(b, l, h)}, got {tuple(dt.shape)}")
    _expect(A.shape == (h,), f"A must be ({h},), got {tuple(A.shape)}")
    _expect(int(chunk_size) > 0, f"chunk_size must be positive, got {chunk_size}")
    _expect(D is None or D.shape in ((h,), (h, p)), f"D must be ({h},) or ({h}, {p}), got {getattr(D, 'shape', None)}")
    _expect(z is None or z.shape == x.shape, f"z must match x {tuple(x.shape)}")
    _expect(dt_bias is None or dt_bias.shape == (h,), f"dt_bias must be ({h},)")
    _expect(
        initial_states is None or initial_states.shape == (b, h, p, n),
        f"initial_states must be {(b, h, p, n)}, got {getattr(initial_states, 'shape', None)}",
    )


def ssd_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    return_varlen_states=False,
):
    """Same arguments, shapes and returns as ``mamba_ssm``'s ``mamba_chunk_scan_combined``.

    x (b, l, h, p), dt (b, l, h), A (h,), B/C (b, l, g, n), D (h,) or (h, p), z like x,
    dt_bias (h,), initial_states (b, h, p, n). Returns y (b, l, h, p) in x's dtype, and with
    ``return_final_states`` also the state after the last token (b, h, p, n) in the compute dtype
    (float32, or float64 for float64 inputs). ``seqlen`` need not be a multiple of ``chunk_size``.
    Packed sequences (``seq_idx`` / ``cu_seqlens`` / varlen states) are refused.
    """
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise UnsupportedKernelFeature(
            "ssd_chunk_scan_combined: packed sequences (seq_idx / cu_seqlens / return_varlen_states) "
            "are not implemented in the pure-torch SSD; train without packed sequences"
        )
    _check(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states)
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    r, q = h // g, int(chunk_size)
    cdt = torch.promote_types(x.dtype, torch.float32)  # mamba_ssm keeps dt, cumsums and states in fp32
    pad = (-l) % q
    c = (l + pad) // q

    # dt is transformed before padding so padded steps get dt = 0: no decay, no input, exact final state.
    dt = _pad_seq(_discretize_dt(dt.to(cdt), dt_bias, dt_softplus, dt_limit), pad).view(b, c, q, g, r)
    xc = _pad_seq(x.to(cdt), pad).view(b, c, q, g, r, p)
    Bg = _pad_seq(B.to(cdt), pad).view(b, c, q, g, n).permute(0, 3, 1, 2, 4)  # (b, g, c, q, n)
    Cg = _pad_seq(C.to(cdt), pad).view(b, c, q, g, n).permute(0, 3, 1, 2, 4)
    dA = (dt * A.to(cdt).view(g, r)).permute(0, 3, 4, 1, 2)  # (b, g, r, c, q)
    dA_cs = dA.cumsum(dim=-1)
    xdt = (xc * dt.unsqueeze(-1)).permute(0, 3, 4, 1, 2, 5)  # (b, g, r, c, q, p)

    # 1. within each chunk: y_l = sum_{s<=l} (C_l . B_s) exp(dA_{s+1..l}) dt_s x_s
    CB = Cg @ Bg.transpose(-1, -2)  # (b, g, c, q, q), shared by the r heads of a group
    y = (CB.unsqueeze(2) * torch.exp(_segsum(dA))) @ xdt  # (b, g, r, c, q, p)

    # 2. each chunk's contribution to the state at its end
    decay_to_end = torch.exp(dA_cs[..., -1:] - dA_cs)  # (b, g, r, c, q), <= 1
    states = (xdt * decay_to_end.unsqueeze(-1)).transpose(-1, -2) @ Bg.unsqueeze(2)  # (b, g, r, c, p, n)

    # 3. across chunks: the state entering chunk k, as one matmul with the chunk-level decay matrix
    if initial_states is None:
        init = states.new_zeros(b, g, r, 1, p, n)
    else:
        init = initial_states.to(cdt).reshape(b, g, r, 1, p, n)
    states = torch.cat([init, states], dim=3).flatten(-2)  # (b, g, r, c+1, p*n)
    chunk_decay = torch.exp(_segsum(F.pad(dA_cs[..., -1], (1, 0))))  # (b, g, r, c+1, c+1)
    states = (chunk_decay @ states).view(b, g, r, c + 1, p, n)

    # 4. entering state read out by C, decayed to each position
    y = y + (Cg.unsqueeze(2) @ states[:, :, :, :-1].transpose(-1, -2)) * torch.exp(dA_cs).unsqueeze(-1)
    y = y.permute(0, 3, 4, 1, 2, 5).reshape(b, c * q, h, p)[:, :l]

    if D is not None:
        y = y + x.to(cdt) * D.to(cdt).view(h, -1)
    if z is not None:
        y = y * F.silu(z.to(cdt))
    y = y.to(x.dtype)
    if not return_final_states:
        return y
    return y, states[:, :, :, -1].reshape(b, h, p, n)
