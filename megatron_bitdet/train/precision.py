"""Low-precision run state: what a restore must bring back beyond parameters and moments, and how.

bf16 / fp16 (megatron's mixed-precision optimizers): the fp32 main params are the *source*; the
16-bit params the model computes with are a *compute copy* derived from them. A restore loads the
source and rebuilds the copy through the very function training uses after each optimizer step
(:func:`rebuild_compute_copy`), so it cannot round differently from training.

FP8: the delayed-scaling state (amax history, scales) is run state like the Adam moments; the
encoded values and scales of the last forward are fingerprinted per step.

NVFP4 (emulated): the stochastic-rounding generators, the Hadamard signs and the weights' encodings
(packed values, block and per-tensor scales) are run state, each a snapshot component of its own.
"""
from __future__ import annotations

import torch

from megatron_bitdet.kernels.fp4_linear import emulated_fp4_modules
from megatron_bitdet.kernels.fp8_linear import emulated_fp8_modules
from megatron_bitdet.train.module_state import named_members, walk

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _mixed_precision_optimizers(optimizer) -> list:
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    return [o for o in _chained(optimizer) if isinstance(o, MixedPrecisionOptimizer) and not o.is_stub_optimizer]


def _walk(ddp_modules) -> list:
    """``module_state.walk`` of the model chunks the DDP modules wrap."""
    return walk([m.module for m in ddp_modules])


def main_params(ddp_modules, walked=None) -> list[tuple[str, torch.Tensor]]:
    """(parameter name, fp32 main param) for every 16-bit parameter with a source on this rank
    (megatron sets ``param.main_param``; with the distributed optimizer it is this rank's shard).
    ``walked``: ``_walk(ddp_modules)``, when the caller has it."""
    walked = _walk(ddp_modules) if walked is None else walked
    return [(f"{i}.{name}", p.main_param) for i, name, p in named_members(walked, "_parameters")
            if getattr(p, "main_param", None) is not None]


def compute_copy_name(ddp_modules) -> str | None:
    """The snapshot component of the model's parameters when they are a compute copy ("bf16_compute_copy"),
    None in a full-precision run (there the parameters are their own source)."""
    dtypes = {p.dtype for m in ddp_modules for p in m.module.parameters()}
    short = sorted(_SHORT[d] for d in dtypes if d in _SHORT)
    return f"{short[0]}_compute_copy" if short else None


@torch.no_grad()
def rebuild_compute_copy(optimizer) -> None:
    """Rebuild the 16-bit compute copy from the restored fp32 source with the function training uses:
    megatron's ``_copy_main_params_to_model_params``, called by ``MixedPrecisionOptimizer.step_with_ready_grads``
    right after every inner optimizer step; with the distributed optimizer followed, as in its
    ``step_with_ready_grads``, by the parameter all-gather (``start_param_sync``) that fills the shards
    other ranks own, synchronous (with ``parallel.overlap_param_gather`` it would only be dispatched)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in _mixed_precision_optimizers(optimizer):
        opt._copy_main_params_to_model_params()
        if isinstance(opt, DistributedOptimizer):
            for chunk in opt.model_chunks:
                chunk.start_param_sync(force_sync=True)


def bf16_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits (round toward zero, not training's nearest-even)."""
    return (x.float().contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


@torch.no_grad()
def fault_round_compute_copy(optimizer) -> None:
    """Test-only restore fault: the compute copy converted from the source with another rounding mode."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in _mixed_precision_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            for group in opt.model_float16_groups:
                for p in group:
                    r = opt._get_model_param_range_map(p)["param"]
                    p.detach().view(-1)[r.start:r.end].copy_(bf16_toward_zero(p.main_param))
            for chunk in opt.model_chunks:
                chunk.start_param_sync(force_sync=True)
        else:
            for group in opt.float16_groups:
                for p in group:
                    p.data.copy_(bf16_toward_zero(p.main_param).view_as(p))


def _te_fp8_state(module) -> dict:
    """Transformer Engine's delayed-scaling meta (GPU): amax history and scale of forward and backward."""
    out = {}
    for key in ("scaling_fwd", "scaling_bwd"):
        meta = getattr(module, "fp8_meta", {}).get(key)
        for attr in ("amax_history", "scale"):
            if meta is not None and torch.is_tensor(getattr(meta, attr, None)):
                out[f"{key}.{attr}"] = getattr(meta, attr)
    return out


def fp8_scaling_state(ddp_modules, walked=None) -> dict[str, torch.Tensor]:
    """Every FP8 scaling-state tensor of the model (emulated linears' buffers, or TE's fp8_meta);
    ``walked``: ``_walk(ddp_modules)``, when the caller has it."""
    out = {}
    for i, name, m in _walk(ddp_modules) if walked is None else walked:
        for attr in ("fp8_amax_history", "fp8_scale"):
            if torch.is_tensor(getattr(m, attr, None)):
                out[f"{i}.{name}.{attr}"] = getattr(m, attr)
        for key, t in _te_fp8_state(m).items():
            out[f"{i}.{name}.{key}"] = t
    return out


def fault_drop_fp8_scaling(ddp_modules) -> None:
    """Test-only restore fault: the scaling state left as a fresh model has it (amax history dropped)."""
    for _, m in emulated_fp8_modules(_walk(ddp_modules)):
        m.reset_fp8_scaling()


def fp4_state(ddp_modules, walked=None) -> dict[str, dict[str, torch.Tensor]]:
    """The emulated NVFP4 linears' run state by snapshot component: ``fp4_sr_rng`` (generator states),
    ``fp4_hadamard_signs``, ``fp4_block_scales`` (block and per-tensor scales of the weights' encodings)
    and ``fp4_values`` (their packed E2M1 bytes as uint8: a differing element is then shown as a byte);
    empty components left out."""
    fp4 = emulated_fp4_modules(_walk(ddp_modules) if walked is None else walked)
    out = {"fp4_sr_rng": {n: m.fp4_sr_generator.get_state() for n, m in fp4 if hasattr(m, "fp4_sr_generator")},
           "fp4_hadamard_signs": {n: m.fp4_hadamard_signs for n, m in fp4 if hasattr(m, "fp4_hadamard_signs")},
           "fp4_block_scales": dict(fp4_encodings(fp4)[1]), "fp4_values": {n: m.fp4_weight_values for n, m in fp4}}
    return {k: v for k, v in out.items() if v}


def fp4_encodings(fp4_modules) -> tuple[list, list]:
    """(name, tensor) of the weights' NVFP4 encodings (``emulated_fp4_modules``): the packed values as
    ``float4_e2m1fn_x2``, and both scale levels (E4M3 block scales, the fp32 per-tensor scale)."""
    values = [(n, m.fp4_weight_values.view(torch.float4_e2m1fn_x2)) for n, m in fp4_modules]
    scales = [item for n, m in fp4_modules for item in ((f"{n}.block", m.fp4_weight_block_scales.view(torch.float8_e4m3fn)),
                                                         (f"{n}.global", m.fp4_weight_global_scale))]
    return values, scales


# Test-only restore faults of the NVFP4 state, by fault name (``snapshot.FAULTS``).
FP4_FAULTS = {"fp4.sr_rng": "reset_sr_generator", "fp4.block_scales": "reset_weight_encoding",
              "fp4.hadamard_signs": "redraw_hadamard_signs"}


def fault_fp4(ddp_modules, fault: str) -> None:
    """A restore that leaves one part of the NVFP4 state wrong (``FP4_FAULTS``) in every emulated linear."""
    for _, m in emulated_fp4_modules(_walk(ddp_modules)):
        getattr(m, FP4_FAULTS[fault])()
