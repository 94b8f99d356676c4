"""Depthwise causal conv1d in plain torch, with ``causal_conv1d.causal_conv1d_fn``'s signature.

The CUDA extension's weight-gradient accumulation is only deterministic from causal_conv1d 1.6 on and
it does not build on CPU; ``F.conv1d`` with the history prepended on the left (``groups=channels``) is
deterministic and differentiable everywhere. Decode (``causal_conv1d_update``) is not needed for
training: megatron's mixer has a torch fallback for it when that name is None.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_bitdet.kernels.ssd import UnsupportedKernelFeature


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
