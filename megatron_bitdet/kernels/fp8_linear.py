"""Emulated FP8 linears: megatron's Column/RowParallelLinear with input, weight and output gradient
quantize-dequantized (``kernels.fp8``), swapped into the local spec by ``patches/fp8_emulated_linear.yaml``
where Transformer Engine cannot run. Settings come from ``config.emulated_fp8`` (the recipe's
``model.fp8``, set by ``model.builder.transformer_config``).

Delayed scaling keeps TE's run state as persistent buffers, so checkpoints carry it like any tensor:
``fp8_amax_history`` (history x roles input / weight / grad_output) and ``fp8_scale`` (per role).
Amaxes are reduced with MAX (exact in any order) over the group TE uses (TP x DP x CP; for experts
expert-TP then expert-DP), so every replica holds the same state and quantizes identically.
"""
from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_bitdet.fingerprint.tensor import dtype_name
from megatron_bitdet.kernels import fp8 as q


def _dtype(fp8, role: int) -> torch.dtype:
    """e4m3 everywhere, except the output gradient (e5m2) in the hybrid format."""
    return q.FORMATS["e5m2" if fp8.format == "hybrid" and q.ROLES[role] == "grad_output" else "e4m3"]


class KeepsStateDtype:
    """Device moves reach the buffers named ``STATE_PREFIX*``; dtype casts (``Float16Module``'s
    ``bfloat16()``) do not: TE keeps scaling state in fp32 (and encoded bytes as they are)."""

    STATE_PREFIX = "fp8_"

    def _apply(self, fn, recurse=True):
        kept = {n: b for n, b in self._buffers.items() if n.startswith(self.STATE_PREFIX) and b is not None}
        result = super()._apply(fn, recurse)
        for n, b in kept.items():
            self._buffers[n] = b.to(device=self._buffers[n].device)
        return result


class _FP8Emulation(KeepsStateDtype):
    def _setup_fp8(self) -> None:
        self.fp8 = self.config.emulated_fp8
        if self.fp8.recipe == "delayed":
            self.register_buffer("fp8_amax_history", torch.zeros(self.fp8.amax_history_len, len(q.ROLES)))
            self.register_buffer("fp8_scale", torch.ones(len(q.ROLES)))
        self.fp8_encoded_weight = None  # the last forward's encoded weight (fingerprinted per step)

    def _reduce_amax(self, a: torch.Tensor) -> torch.Tensor:
        if self.is_expert:
            groups = (ps.get_expert_tensor_parallel_group(), ps.get_expert_data_parallel_group())
        else:
            groups = (ps.get_amax_reduction_group(with_context_parallel=True),)
        for group in groups:
            if group is not None and torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(a, op=torch.distributed.ReduceOp.MAX, group=group)
        return a

    @torch.no_grad()
    def _scale(self, x: torch.Tensor, role: int, dtype: torch.dtype) -> torch.Tensor:
        """The scale this quantization uses; delayed scaling then records the amax and moves on."""
        a = self._reduce_amax(q.amax(x))
        if self.fp8.recipe == "tensorwise":
            return q.scale_from_history(a.view(1), dtype, margin=self.fp8.margin, algo="most_recent")
        scale = self.fp8_scale[role].clone()
        history = self.fp8_amax_history[:, role]
        history.copy_(torch.roll(history, 1))
        history[0] = a
        self.fp8_scale[role] = q.scale_from_history(history, dtype, margin=self.fp8.margin,
                                               algo=self.fp8.amax_compute_algo)
        return scale

    def _qdq(self, x: torch.Tensor, role: int) -> torch.Tensor:
        dtype = _dtype(self.fp8, role)
        if self.fp8.recipe == "mxfp8":
            encoded = q.quantize_blockwise(x, dtype)
            out = q.dequantize_blockwise(encoded, x.shape, x.dtype)
        else:
            scale = self._scale(x, role, dtype)
            values = q.quantize_tensorwise(x, scale, dtype)
            encoded = q.BlockedTensor(values, scale, format=f"tensor_{dtype_name(dtype)}", block_size=x.numel())
            out = q.dequantize_tensorwise(values, scale, x.dtype)
        if q.ROLES[role] == "weight":
            self.fp8_encoded_weight = encoded
        return out

    def _forward_impl(self, input, weight, *args, **kwargs):
        x = q.fake_quantize(input, partial(self._qdq, role=0))
        w = q.fake_quantize(weight, partial(self._qdq, role=1))
        out = super()._forward_impl(x, w, *args, **kwargs)
        return q.quantize_grad(out, partial(self._qdq, role=2))

    def reset_fp8_scaling(self) -> None:
        """A fresh module's scaling state (what a restore that drops it leaves; fault tests only)."""
        if self.fp8.recipe == "delayed":
            self.fp8_amax_history.zero_()
            self.fp8_scale.fill_(1.0)


class EmulatedFP8ColumnParallelLinear(_FP8Emulation, ColumnParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_fp8()


class EmulatedFP8RowParallelLinear(_FP8Emulation, RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_fp8()


def emulated_fp8_modules(walked) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every emulated FP8 linear among a model's (chunk index, path, module)
    triples (``train.module_state.walk``)."""
    return [(f"{i}.{name}", m) for i, name, m in walked if isinstance(m, _FP8Emulation)]
