"""Layer specs for Megatron-LM's ``--spec MODULE NAME`` (``pretrain_mamba.py``).

``--spec megatron_bitdet.megatron_lm.specs local_mamba_stack_spec``: bitdet's pure-torch hybrid stack
(Mamba-2 with the deterministic kernels swapped in, attention, MLP, MoE); runs on CPU. On a GPU,
megatron-core's own TE spec (``--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec``)
runs with the same swaps.
"""
from megatron_bitdet.model.specs import local_stack_spec

# The MoE layer spec only needs to know that experts exist; MoELayer reads their count from the config.
local_mamba_stack_spec = local_stack_spec(num_experts=1)
