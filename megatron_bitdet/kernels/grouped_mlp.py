"""Grouped expert MLP with the routing probability fused into the fc1 epilogue; deterministic dprob.

Forward, all experts at once (segment GEMMs over the token groups, ``torch.nn.functional.grouped_mm``):
``h = x W1_e^T``, ``s = act(h) * prob``, ``y = s W2_e^T``. In the backward, the fc2 dgrad GEMM
``ds = dy W2_e`` is tiled along its N axis (the ffn dim); fused upstream kernels add each N-tile's
``sum(ds * act(h))`` into ``dprob[token]`` with float atomics, so the bits follow arrival order. Here
every N-tile writes a private slot of ``dprob_slots[token, tile]`` and the slots are combined by the
fixed pairwise tree (:func:`~megatron_bitdet.kernels.moe_aux.tree_sum`) after all tiles are done.

:class:`GroupedProbMLP` is an expert implementation for megatron's ``MoELayer``: it *is* a
``SequentialMLP`` (same constructor, parameters ``local_experts.{i}.linear_fc{1,2}.weight``,
``sharded_state_dict`` and therefore checkpoints) whose ``forward`` runs the grouped path instead of
the per-expert loop. Expert linears do no communication themselves (megatron's token dispatcher
does), so using their weights directly is exact for every TP/EP layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.kernels.moe_aux import tree_sum


BACKENDS = ("torch", "triton", "triton_atomic")


@dataclass(frozen=True)
class GroupedMLPConfig:
    """dprob_tile_n: N-tile width of the fc2 dgrad GEMM (one private dprob slot per tile).
    backend: "torch" (any device), "triton" (GPU, private slots), "triton_atomic" (GPU, the
    nondeterministic atomic-add baseline, for benchmarks only)."""

    dprob_tile_n: int = 64
    backend: str = "torch"

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise BitdetInputError(f"grouped MLP backend must be one of {BACKENDS}, got {self.backend!r}")
        n = self.dprob_tile_n
        if n < 16 or n & (n - 1):  # Triton tiles need a power of two >= 16; the torch path agrees
            raise BitdetInputError(f"dprob_tile_n must be a power of two >= 16, got {n}")


def backend_unavailable(backend: str) -> str | None:
    """Why a GPU backend cannot run in this process (None: it can): triton must import and CUDA exist."""
    if backend == "torch":
        return None
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install '.[gpu]')"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def _segment_mm(a, b, offs):
    return F.grouped_mm(a, b, offs=offs)


def dprob_slots(ds: torch.Tensor, act_out: torch.Tensor, tile_n: int) -> torch.Tensor:
    """[tokens, n_tiles]: slot j = sum over N-tile j of ``ds * act_out`` (fixed tree within the tile)."""
    prod = ds * act_out
    pad = -prod.shape[1] % tile_n
    if pad:
        prod = F.pad(prod, (0, pad))  # zeros add exactly
    return tree_sum(prod.unflatten(1, (-1, tile_n)), dim=2)


class _GroupedProbMLPFn(torch.autograd.Function):
    """Custom backward: the dprob reduction goes through private per-tile slots in a fixed order."""

    @staticmethod
    def forward(ctx, x, probs, w1, w2, offs, activation, tile_n):
        h = _segment_mm(x, w1.transpose(1, 2), offs)
        a = activation(h)
        s = (a * probs.unsqueeze(-1)).to(a.dtype)
        ctx.save_for_backward(x, probs, w1, w2, offs, h)
        ctx.activation, ctx.tile_n = activation, tile_n
        return _segment_mm(s, w2.transpose(1, 2), offs)

    @staticmethod
    def backward(ctx, dy):
        x, probs, w1, w2, offs, h = ctx.saved_tensors
        with torch.enable_grad():  # recompute act(h) to differentiate it exactly as autograd would
            h_leaf = h.detach().requires_grad_(True)
            a = ctx.activation(h_leaf)
        dy = dy.contiguous()
        ds = _segment_mm(dy, w2, offs).to(torch.result_type(a, probs))
        dprob = tree_sum(dprob_slots(ds, a.detach(), ctx.tile_n), dim=1).to(probs.dtype)
        (dh,) = torch.autograd.grad(a, h_leaf, (ds * probs.unsqueeze(-1)).to(a.dtype))
        s = (a.detach() * probs.unsqueeze(-1)).to(a.dtype)
        dx = _segment_mm(dh, w1, offs)
        dw1 = _segment_mm(dh.t(), x, offs)
        dw2 = _segment_mm(dy.t(), s, offs)
        return dx, dprob, dw1, dw2, None, None, None


def grouped_prob_mlp(
    x: torch.Tensor,
    probs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
    config: GroupedMLPConfig = GroupedMLPConfig(),
) -> torch.Tensor:
    """x [T, H] grouped by expert, probs [T], w1 [E, F1, H], w2 [E, H, F], tokens_per_expert [E]."""
    offs = torch.cumsum(torch.as_tensor(tokens_per_expert, device=x.device), 0).to(torch.int32)
    if config.backend == "torch":
        return _GroupedProbMLPFn.apply(x, probs, w1, w2, offs, activation, config.dprob_tile_n)
    from megatron_bitdet.kernels import triton_grouped  # GPU-only extra, imported on demand

    return triton_grouped.grouped_prob_mlp(x, probs, w1, w2, offs, activation, config)


def megatron_activation(config) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation megatron's MLP applies in its unfused branch (GLU with clamp/offset included)."""
    act = config.activation_func
    if not config.gated_linear_unit:
        return act
    clamp, offset = config.activation_func_clamp_value, config.glu_linear_offset

    def glu(h):
        x_glu, x_linear = torch.chunk(h, 2, dim=-1)
        if clamp is not None:
            x_glu, x_linear = x_glu.clamp(min=None, max=clamp), x_linear.clamp(min=-clamp, max=clamp)
        return act(x_glu) * (x_linear + offset)

    return glu


class GroupedProbMLP(SequentialMLP):
    """SequentialMLP's weights and interface, grouped computation with a deterministic dprob."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None,
                 kernel_config: Optional[GroupedMLPConfig] = None, **megatron_kwargs):
        unsupported = [
            name
            for name, on in (
                ("fp8", config.fp8),
                ("fp4", config.fp4),
                ("add_bias_linear", config.add_bias_linear),
                ("use_te_activation_func", config.use_te_activation_func),
                ("moe_latent_size", config.moe_latent_size is not None),
            )
            if on
        ]
        if unsupported:
            raise BitdetInputError(f"GroupedProbMLP does not support {', '.join(unsupported)}; use SequentialMLP")
        super().__init__(num_local_experts, config, submodules, pg_collection, **megatron_kwargs)  # 0.19: name
        self.kernel_config = kernel_config or GroupedMLPConfig()
        self.expert_activation = megatron_activation(self.config)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        """Same contract as ``SequentialMLP.forward``: returns (output, None)."""
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise BitdetInputError("moe_apply_probs_on_input only works with moe_router_topk=1")
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        w1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])
        w2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        out = grouped_prob_mlp(hidden, probs, w1, w2, tokens_per_expert, self.expert_activation, self.kernel_config)
        return out, None
