"""Depthwise causal conv1d in plain torch (``causal_conv1d.causal_conv1d_fn``'s signature), and the
conv+scan composition behind megatron's memory-efficient Mamba path.

The CUDA extension's weight-gradient accumulation is only deterministic from causal_conv1d 1.6 on and
it does not build on CPU; ``F.conv1d`` with the history prepended on the left (``groups=channels``) is
deterministic and differentiable everywhere. Decode (``causal_conv1d_update``) is not needed for
training: megatron's mixer has a torch fallback for it when that name is None.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_bitdet.kernels.ssd import UnsupportedKernelFeature, ssd_chunk_scan_combined


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """x (batch, dim, seqlen), weight (dim, width), bias (dim,), initial_states (batch, dim, width-1).

    out[:, d, t] = bias[d] + sum_k weight[d, k] * x[:, d, t - (width-1) + k], with x before t=0 taken
    from ``initial_states`` (zeros when None); then SiLU if ``activation`` is "silu"/"swish".
    Returns out (x's dtype), and with ``return_final_states`` the last width-1 inputs as well.
    """
    if seq_idx is not None:
        raise UnsupportedKernelFeature("causal_conv1d_fn: seq_idx (packed sequences) is not implemented in the pure-torch conv")
    if activation not in (None, "silu", "swish"):
        raise UnsupportedKernelFeature(f"causal_conv1d_fn: activation must be None, 'silu' or 'swish', got {activation!r}")
    dim, width = weight.shape
    xin = x.to(weight.dtype)
    if initial_states is None:
        xin = F.pad(xin, (width - 1, 0))
    else:
        xin = torch.cat([initial_states.to(weight.dtype), xin], dim=-1)
    out = F.conv1d(xin, weight.unsqueeze(1), bias, groups=dim)
    if activation is not None:
        out = F.silu(out)
    out = out.to(x.dtype)
    if not return_final_states:
        return out
    final = xin[..., xin.shape[-1] - (width - 1):].to(x.dtype)
    if final_states_out is not None:
        final = final_states_out.copy_(final)
    return out, final


def ssd_split_conv1d_scan_combined(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    initial_states=None,
    seq_idx=None,
    dt_limit=(0.0, float("inf")),
    return_final_states=False,
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    outproj_weight=None,
    outproj_bias=None,
    headdim=None,
    ngroups=1,
    norm_before_gate=True,
):
    """``mamba_ssm``'s ``mamba_split_conv1d_scan_combined`` (megatron's ``use_mamba_mem_eff_path``) as
    composition: split zxbcdt (b, l, z|xBC|dt) → causal conv + activation on xBC → SSD scan with
    softplus(dt + dt_bias), D skip and silu(z) gating. Returns (b, l, nheads*headdim) [, final states].
    Not memory-efficient (autograd keeps the intermediates). The fused RMSNorm / out-projection
    options (which megatron does not pass) and a non-SSM zx0 part are refused."""
    if rmsnorm_weight is not None or outproj_weight is not None or outproj_bias is not None:
        raise UnsupportedKernelFeature("ssd_split_conv1d_scan_combined: fused rmsnorm/outproj are not implemented")
    nheads = D.shape[0]
    headdim = D.shape[1] if D.dim() == 2 else headdim
    if headdim is None:
        raise UnsupportedKernelFeature("ssd_split_conv1d_scan_combined: headdim is required when D is (nheads,)")
    dim = nheads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    if zxbcdt.shape[-1] != 2 * dim + 2 * ngroups * dstate + nheads:
        raise UnsupportedKernelFeature(
            f"ssd_split_conv1d_scan_combined: last dim {zxbcdt.shape[-1]} is not z|xBC|dt "
            f"= {2 * dim + 2 * ngroups * dstate + nheads} (a non-SSM zx0 part is not implemented)"
        )
    b, l, _ = zxbcdt.shape
    z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation)
    x, B, C = torch.split(xBC.transpose(1, 2), [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    out = ssd_chunk_scan_combined(
        x.reshape(b, l, nheads, headdim),
        dt,
        A,
        B.reshape(b, l, ngroups, dstate),
        C.reshape(b, l, ngroups, dstate),
        chunk_size,
        D=D,
        z=z.reshape(b, l, nheads, headdim),
        dt_bias=dt_bias,
        initial_states=initial_states,
        seq_idx=seq_idx,
        dt_softplus=True,
        dt_limit=dt_limit,
        return_final_states=return_final_states,
    )
    if return_final_states:
        return out[0].reshape(b, l, dim), out[1]
    return out.reshape(b, l, dim)
