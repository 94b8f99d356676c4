"""Layer specs for Megatron-LM's ``--spec MODULE NAME`` (``pretrain_mamba.py``).

``--spec megatron_bitdet.megatron_lm.specs local_mamba_stack_spec``: bitdet's pure-torch hybrid stack
(Mamba-2 with the deterministic kernels swapped in, attention, MLP, MoE); runs on CPU.

``--spec megatron_bitdet.megatron_lm.specs te_mamba_stack_spec``: megatron-core's own TE hybrid spec
(``megatron.core.models.mamba.mamba_layer_specs.mamba_stack_spec``: TE fused norm+linear, TE attention)
with its MoE experts — ``TEGroupedMLP`` with TE, the legacy ``GroupedMLP`` without, whatever the flags say —
replaced by bitdet's GroupedProbMLP on the TE linears the spec's shared experts use. The Mamba kernels are
the enforcement's swaps, as for any spec; megatron-core's own object is left as it is.

``local_mamba_stack_spec_chunk{C}_conv{K}`` (and the ``te_`` one): the same stack with the Mamba mixer's
chunk size and conv width (no Megatron-LM flag sets them; megatron-core's defaults are 128 and 4), as
``bitdet recipe megatron-args`` renders a recipe's ``model.mamba.chunk_size`` / ``conv_kernel``.
"""
import copy
import re

from megatron_bitdet.model.specs import local_stack_spec

_SIZED = re.compile(r"(local|te)_mamba_stack_spec_chunk(\d+)_conv(\d+)")
# megatron's import_module is ``__import__(MODULE, fromlist=[NAME])`` then ``vars(module)[NAME]``: the
# fromlist asks for NAME (so __getattr__ builds it) only of a package; an empty __path__ makes this one
__path__: list = []

# The MoE layer spec only needs to know that experts exist; MoELayer reads their count from the config.
local_mamba_stack_spec = local_stack_spec(num_experts=1)


def __getattr__(name):
    """``te_mamba_stack_spec`` is built on first use (importing megatron's TE spec module is not free), and
    so is each ``*_chunk{C}_conv{K}`` stack."""
    sized = _SIZED.fullmatch(name)
    if sized:
        family, chunk, conv = sized.groups()
        spec = copy.deepcopy(globals()[f"{family}_mamba_stack_spec"] if family == "local" else __getattr__(
            "te_mamba_stack_spec"))
        spec.submodules.mamba_layer.submodules.mixer.params = {"chunk_size": int(chunk), "d_conv": int(conv)}
        globals()[name] = spec
        return spec
    if name != "te_mamba_stack_spec":
        raise AttributeError(name)
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec

    from megatron_bitdet.enforce.audit import swap_grouped_experts

    spec, _ = swap_grouped_experts(mamba_stack_spec, copy=True)
    globals()[name] = spec
    return spec
