"""The hybrid (Mamba) stack across megatron-core versions: its layers as Megatron-LM builds them from a launch
line, and whether it takes the virtual pipeline. Through 0.16.1 the line gives
``--hybrid-override-pattern`` or ``--num-layers`` with ``--hybrid-attention-ratio`` / ``--hybrid-mlp-ratio``
(``allocate_layers`` places the symbols); from 0.18 it gives ``--hybrid-layer-pattern`` (core_v0.19.0's
``examples/mamba/train.sh``), which ``validate_args`` also fills from the deprecated override, with MTP depths
after ``/`` and pipeline segments split by ``|``; the ratio flags are gone."""
from __future__ import annotations

from packaging.specifiers import SpecifierSet

from megatron_bitdet.compat.versions import megatron_core_version, supports


def decoder_pattern(a) -> str | None:
    """One symbol per decoder layer (MTP depths and ``|`` left out), or None where the line builds no hybrid
    stack."""
    given = getattr(a, "hybrid_layer_pattern", None) or getattr(a, "hybrid_override_pattern", None)
    if given:
        return given.split("/")[0].replace("|", "")
    if getattr(a, "is_hybrid_model", False) or getattr(a, "hybrid_attention_ratio", 0.0):
        from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers

        return "".join(allocate_layers(a.num_layers, a.hybrid_attention_ratio, a.hybrid_mlp_ratio, None))
    return None


def stack_refuses_virtual_pipeline() -> bool:
    """0.16.1's ``MambaStack`` asserts 'The Mamba hybrid model does not currently support virtual/interleaved
    pipeline parallelism' in every rank; 0.18's ``HybridStack`` has no such assert (read in the 0.19.2 sources):
    its virtual stages are the pattern's ``|`` segments, and ``validate_args`` itself refuses
    ``--num-layers-per-virtual-pipeline-stage`` / ``--num-virtual-stages-per-pipeline-rank`` beside a pattern."""
    return not supports(megatron_core_version(), SpecifierSet(">=0.18"))
