"""Layer specs for the hybrid Nemotron stack: what is built is data (megatron ModuleSpec).

``local``: pure torch, runs anywhere (CPU included); the Mamba kernels and the final norm are bitdet's,
swapped in by ``patches/`` before the spec is built, and with ``expert_impl: grouped`` the experts are
bitdet's GroupedProbMLP, chosen through megatron's own backend spec provider seam. Every linear comes
from that provider too (megatron's ``LocalSpecProvider`` bindings, read when the spec is built): the
binding the emulated-FP8 swap replaces. ``te``: Transformer Engine's fused layers (megatron's own
``mamba_stack_spec``), used when TE imports.
"""
from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron_bitdet.compat import builders
from megatron_bitdet.kernels.grouped_mlp import GroupedProbMLP
from megatron_bitdet.model.norm import LocalNorm


class ExpertSpecProvider(LocalSpecProvider):
    """megatron's local backend, except that ``model.moe.expert_impl: grouped`` gets GroupedProbMLP
    (private-slot dprob; a SequentialMLP subclass: same weights and checkpoints)."""

    def __init__(self, expert_impl: str = "sequential"):
        self.expert_impl = expert_impl

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, *legacy):
        """megatron's, with GroupedProbMLP built instead (``legacy``: before 0.17, the
        ``moe_use_legacy_grouped_gemm`` argument; the shape returned: ``compat.builders``)."""
        built = super().grouped_mlp_modules(moe_use_grouped_gemm, *legacy)
        if self.expert_impl == "grouped" and not moe_use_grouped_gemm:
            return builders.with_module(built, GroupedProbMLP)
        return built


def local_stack_spec(*, num_experts: int = 0, mamba_params=None, expert_impl: str = "sequential") -> ModuleSpec:
    """The pure-torch hybrid stack: Mamba-2, attention, MLP and MoE layers."""
    backend = ExpertSpecProvider(expert_impl)
    column, row = backend.column_parallel_linear(), backend.row_parallel_linear()
    moe_layer = None
    if num_experts:
        moe_layer = ModuleSpec(
            module=MoETransformerLayer,
            submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=LocalNorm, mlp=get_moe_module_spec_for_backend(backend, num_experts=num_experts),
                mlp_bda=get_bias_dropout_add,
            ),
        )
    return ModuleSpec(
        module=MambaStack,
        submodules=MambaStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=LocalNorm,
                    mixer=ModuleSpec(
                        module=MambaMixer,
                        params=dict(mamba_params or {}),
                        submodules=MambaMixerSubmodules(in_proj=column, out_proj=row),
                    ),
                    mamba_bda=get_bias_dropout_add,
                ),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=LocalNorm,
                    self_attention=ModuleSpec(
                        module=SelfAttention,
                        params={"attn_mask_type": AttnMaskType.causal},
                        submodules=SelfAttentionSubmodules(
                            linear_qkv=column,
                            core_attention=DotProductAttention,
                            linear_proj=row,
                        ),
                    ),
                    self_attn_bda=get_bias_dropout_add,
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=LocalNorm,
                    mlp=ModuleSpec(
                        module=MLP,
                        submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row),
                    ),
                    mlp_bda=get_bias_dropout_add,
                ),
            ),
            **({"moe_layer": moe_layer} if moe_layer else {}),
        ),
    )


def te_stack_spec(*, num_experts: int = 0, mamba_params=None, grouped_gemm: bool = False) -> ModuleSpec:
    """megatron-core's TE hybrid spec (fused norm+linear, TE attention). Its MoE layer is rebuilt for
    the recipe: megatron's copy is built with TEGroupedMLP (TE's atomic dprob) whatever the recipe
    says; ``grouped_gemm`` False (expert_impl sequential/grouped, or te_grouped swapped) takes the TE
    provider's SequentialMLP, which the grouped_gemm_dprob patch turns into GroupedProbMLP."""
    import copy

    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    spec = copy.deepcopy(mamba_stack_spec)
    spec.submodules.mamba_layer.submodules.mixer.params = dict(mamba_params or {})
    if num_experts:
        spec.submodules.moe_layer.submodules.mlp = get_moe_module_spec_for_backend(
            TESpecProvider(), num_experts=num_experts, moe_grouped_gemm=grouped_gemm)
    return spec
