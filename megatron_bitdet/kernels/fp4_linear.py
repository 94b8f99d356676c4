"""Emulated NVFP4 linears: megatron's Column/RowParallelLinear computing their three GEMMs the way
NVIDIA's NVFP4 training recipe does ("Pretraining Large Language Models with NVFP4", NVIDIA 2025,
arXiv 2509.25149; emulation in ``kernels.fp4``), swapped into the local spec by
``patches/fp4_emulated_linear.yaml`` where Transformer Engine cannot run. Settings: ``config.emulated_fp4``
(the recipe's ``model.fp4``, set by ``model.builder.transformer_config``).

- fprop ``y = x W^T``: input in 1x16 blocks, weight in 16x16 blocks (``weight_2d_scaling``; else 1x16),
  both rounded to nearest;
- dgrad ``dx = dy W``: the output gradient in 1x16 blocks, rounded stochastically
  (``stochastic_rounding``), against the forward's quantized weight (2D) or the weight re-quantized
  along its other dimension (1D);
- wgrad ``dW = dy^T x``: both operands random-Hadamard-transformed along the token dimension
  (``hadamard``), then quantized in 1x16 blocks along it (gradient stochastic, activation nearest).

Run state, as persistent buffers and a generator attribute, so checkpoints, restores, snapshots and
fingerprints carry it (``train.precision.fp4_state``):
``fp4_sr_generator`` (a ``torch.Generator`` of its own: stochastic rounding never draws from the
streams dropout uses); ``fp4_hadamard_signs`` (the transform's sign vector, drawn once from
``model.fp4.hadamard_seed``: one vector for every layer, as in the recipe); and the weight's encoding of
the last forward, ``fp4_weight_values`` (packed E2M1 bytes), ``fp4_weight_block_scales`` (E4M3 bytes)
and ``fp4_weight_global_scale`` (fp32), sharded like the weight in checkpoints. Megatron's TP / SP
communication stays megatron's own (``mappings``); only the local GEMMs are replaced.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
)

from megatron_bitdet.errors import BitdetError
from megatron_bitdet.kernels import fp4 as q
from megatron_bitdet.kernels.fp8_linear import KeepsStateDtype

WORKSPACE = ("fp4_weight_values", "fp4_weight_block_scales", "fp4_weight_global_scale")


class _NVFP4GEMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer):
        x2 = x.reshape(-1, x.shape[-1])
        wq = layer._encode_weight(weight)
        w = q.dequantize(wq, x.dtype)
        ctx.layer, ctx.x_shape = layer, x.shape
        ctx.save_for_backward(x2, weight, w)
        return (q.dequantize(q.quantize(x2), x.dtype) @ w.t()).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        x2, weight, w = ctx.saved_tensors
        layer, fp4 = ctx.layer, ctx.layer.fp4
        gen = layer.fp4_sr_generator if fp4.stochastic_rounding else None
        dy = grad.reshape(-1, grad.shape[-1])
        if not fp4.weight_2d_scaling:  # 1x16 blocks along the dgrad's reduction dim (the weight's rows)
            w = q.dequantize(q.quantize(weight.t()), x2.dtype).t()
        dx = q.dequantize(q.quantize(dy, generator=gen), x2.dtype) @ w
        a, b = dy.t(), x2.t()
        if fp4.hadamard:
            signs = layer.fp4_hadamard_signs
            a, b = q.random_hadamard(a, signs), q.random_hadamard(b, signs)
        dw = (q.dequantize(q.quantize(a, generator=gen), x2.dtype, trim=False)
              @ q.dequantize(q.quantize(b), x2.dtype, trim=False).t())
        return dx.view(ctx.x_shape), dw[: weight.shape[0], : weight.shape[1]].to(weight.dtype), None


class _FP4Emulation(KeepsStateDtype):
    STATE_PREFIX = "fp4_"
    TP_AXIS = 0

    def _setup_fp4(self) -> None:
        self.fp4 = self.config.emulated_fp4
        if self.gradient_accumulation_fusion:
            raise BitdetError("the emulated NVFP4 linear returns its weight gradient through autograd: it needs "
                              "megatron's gradient_accumulation_fusion off")
        device = self.weight.device
        rows, cols = self.weight.shape
        br = q.BLOCK if self.fp4.weight_2d_scaling else 1
        prows, pcols = -(-rows // q.BLOCK) * q.BLOCK, -(-cols // q.BLOCK) * q.BLOCK
        self.register_buffer("fp4_weight_values", torch.zeros(prows, pcols // 2, dtype=torch.uint8, device=device))
        self.register_buffer("fp4_weight_block_scales",
                             torch.zeros(prows // br, pcols // q.BLOCK, dtype=torch.uint8, device=device))
        self.register_buffer("fp4_weight_global_scale", torch.ones(1, 1, device=device))
        if self.fp4.hadamard:
            self.register_buffer("fp4_hadamard_signs", self._draw_signs())
        if self.fp4.stochastic_rounding:
            # seeded from the default generator at build: the same on every rank of a build, advanced per use
            self.fp4_sr_seed = int(torch.randint(0, 2 ** 62, (1,)))
            self.fp4_sr_generator = torch.Generator(device=device).manual_seed(self.fp4_sr_seed)

    def _draw_signs(self, seed: int | None = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.fp4.hadamard_seed if seed is None else seed)
        return q.draw_signs(g).to(self.weight.device)

    @torch.no_grad()
    def _encode_weight(self, weight: torch.Tensor) -> q.NVFP4Tensor:
        """The weight's encoding for this forward, kept in the workspace buffers (fingerprinted per step)."""
        enc = q.quantize(weight, block=(q.BLOCK if self.fp4.weight_2d_scaling else 1, q.BLOCK))
        self.fp4_weight_values.copy_(enc.values.view(torch.uint8))
        self.fp4_weight_block_scales.copy_(enc.block_scales.view(torch.uint8))
        self.fp4_weight_global_scale.fill_(enc.global_scale)
        return enc

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                      tp_group=None, **_):
        """megatron's ``linear_with_grad_accumulation_and_async_allreduce`` with NVFP4 GEMMs: the same
        collectives (SP all-gather / reduce-scatter, or the dgrad all-reduce) around them."""
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(input, group=tp_group)
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        out = _NVFP4GEMM.apply(input, weight, self)
        return out if bias is None else out + bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """megatron's, with the weight's encoding sharded along the weight's TP axis (each rank encodes
        its own shard); the Hadamard signs are replicated like any other buffer."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = {"weight": self.TP_AXIS, **{k: self.TP_AXIS for k in WORKSPACE}}
        if self.TP_AXIS == 0:
            axes["bias"] = 0
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    # Test-only restore faults (what a buggy resume leaves).
    def reset_sr_generator(self) -> None:
        """The generator as the build seeded it."""
        self.fp4_sr_generator.manual_seed(self.fp4_sr_seed)

    @torch.no_grad()
    def reset_weight_encoding(self) -> None:
        """The workspace as a fresh module has it."""
        self.fp4_weight_values.zero_()
        self.fp4_weight_block_scales.zero_()
        self.fp4_weight_global_scale.fill_(1.0)

    @torch.no_grad()
    def redraw_hadamard_signs(self) -> None:
        """Signs drawn anew from another seed instead of restored (no run generator is touched, so only
        the signs differ)."""
        self.fp4_hadamard_signs.copy_(self._draw_signs(self.fp4.hadamard_seed + 1))


class EmulatedFP4ColumnParallelLinear(_FP4Emulation, ColumnParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_fp4()


class EmulatedFP4RowParallelLinear(_FP4Emulation, RowParallelLinear):
    TP_AXIS = 1

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_fp4()


def emulated_fp4_modules(walked) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of every emulated NVFP4 linear among a walk's triples."""
    return [(f"{i}.{name}", m) for i, name, m in walked if isinstance(m, _FP4Emulation)]


def te_nvfp4_recipe(fp4):
    """Transformer Engine's ``NVFP4BlockScaling`` (TE >= 2.7, Blackwell) with ``model.fp4``'s parts:
    the same keys as the emulation. ImportError naming what is missing where TE cannot provide it."""
    try:
        from transformer_engine.common.recipe import Format, NVFP4BlockScaling
    except Exception as exc:  # TE raises OSError/RuntimeError too where CUDA is missing
        raise ImportError(f"TE's NVFP4BlockScaling needs transformer_engine >= 2.7 ({type(exc).__name__}: {exc})") \
            from None
    return NVFP4BlockScaling(fp4_format=getattr(Format, fp4.format.upper()), disable_rht=not fp4.hadamard,
                             disable_stochastic_rounding=not fp4.stochastic_rounding,
                             disable_2d_quantization=not fp4.weight_2d_scaling)


def te_nvfp4_twice(repeats: int = 20, shape=(256, 512, 256)) -> tuple[int, float]:
    """The GPU check's NVFP4 row (``benchmarks/gpu_check.py``): a TE Linear forward + backward under
    ``te_nvfp4_recipe`` of the default ``model.fp4``, ``repeats`` times from the same inputs and RNG
    state (stochastic rounding included). Returns (distinct results over output, dgrad and wgrad bytes;
    1 = bitwise repeatable, mean ms)."""
    import time

    import transformer_engine.pytorch as te
    import xxhash

    from megatron_bitdet.recipe.schema import FP4Config

    recipe = te_nvfp4_recipe(FP4Config(recipe="nvfp4"))
    tokens, k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    layer = te.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    state, digests, t0 = torch.cuda.get_rng_state(), set(), time.perf_counter()
    for _ in range(repeats):
        torch.cuda.set_rng_state(state)
        layer.weight.grad = None
        x = x0.clone().requires_grad_()
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            out = layer(x)
        out.backward(dy)
        h = xxhash.xxh3_64()
        for t in (out, x.grad, layer.weight.grad):
            h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
        digests.add(h.hexdigest())
    torch.cuda.synchronize()
    return len(digests), (time.perf_counter() - t0) * 1000 / repeats
