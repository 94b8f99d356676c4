"""RMSNorm / LayerNorm for the local (pure torch) spec.

megatron-core's ``WrappedTorchNorm`` refuses ``sequence_parallel=True``; this one accepts it and
marks its parameters ``sequence_parallel`` so megatron reduces their grads over the TP group.
"""
from __future__ import annotations

import torch


class LocalNorm(torch.nn.Module):
    """Norm with megatron's constructor signature (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__()
        self.normalization = config.normalization
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"unsupported normalization {config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = (
            torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
            if self.normalization == "LayerNorm"
            else None
        )
        for p in self.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)

    def forward(self, x):
        if self.normalization == "RMSNorm":
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
