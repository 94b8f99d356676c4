"""Gated (grouped) RMSNorm in plain torch, a drop-in for mamba_ssm's Triton ``RMSNorm`` (``RMSNormGated``).

The Triton backward sums the weight gradient over a device-dependent number of row blocks; here autograd
reduces with torch's fixed-order CPU/GPU reductions. Semantics follow ``mamba_ssm``'s ``rms_norm_ref``:
``norm_before_gate=False`` normalizes ``x * silu(z)``, ``True`` multiplies ``norm(x)`` by ``silu(z)``;
each ``group_size`` slice of the last dim is normalized on its own. Computation is in float32 (float64
stays float64), the result is cast back to ``x``'s dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rms_norm(x, weight, bias=None, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """Functional form, argument order of ``mamba_ssm``'s ``rmsnorm_fn``."""
    cdt = torch.promote_types(x.dtype, torch.float32)
    h = x.to(cdt)
    gate = F.silu(z.to(cdt)) if z is not None else None
    if gate is not None and not norm_before_gate:
        h = h * gate
    d = h.shape[-1]
    group_size = d if group_size is None else group_size
    hg = h.unflatten(-1, (d // group_size, group_size))
    out = (hg * torch.rsqrt(hg.square().mean(dim=-1, keepdim=True) + eps)).flatten(-2) * weight.to(cdt)
    if bias is not None:
        out = out + bias.to(cdt)
    if gate is not None and norm_before_gate:
        out = out * gate
    return out.to(x.dtype)


class GatedRMSNorm(torch.nn.Module):
    """Constructor, parameter names (``weight``; ``bias`` registered as None) and ``forward(x, z=None)``
    of ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``, plus megatron's ``ExtendedRMSNorm``
    ``sharded_state_dict`` (weight split along dim 0 over tensor parallelism), so it replaces
    ``megatron.core.ssm.mamba_mixer.ExtendedRMSNorm`` with checkpoints unchanged."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        if group_size is not None and hidden_size % group_size:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of group_size {group_size}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return gated_rms_norm(x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """As megatron's ExtendedRMSNorm: weight TP-sharded along axis 0 (megatron imported lazily)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if not hasattr(self, "tp_group"):
            self.tp_group = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
