"""Layer specs for Megatron-LM's ``--spec MODULE NAME`` (``pretrain_mamba.py``).

``--spec megatron_bitdet.megatron_lm.specs local_mamba_stack_spec``: bitdet's pure-torch hybrid stack
(Mamba-2 with the deterministic kernels swapped in, attention, MLP, MoE); runs on CPU.

``--spec megatron_bitdet.megatron_lm.specs te_mamba_stack_spec``: megatron-core's own TE hybrid spec
(``megatron.core.models.mamba.mamba_layer_specs.mamba_stack_spec``: TE fused norm+linear, TE attention)
with its MoE experts — ``TEGroupedMLP`` with TE, whatever the flags say, and before megatron-core 0.17 the
legacy ``GroupedMLP`` without (from 0.17 it builds ``SequentialMLP`` there, left as it is) — replaced by
bitdet's GroupedProbMLP on the linears the spec's shared experts use, in the node's own shape (a
``functools.partial`` builder from 0.17: ``compat.builders``). The Mamba kernels are
the enforcement's swaps, as for any spec; megatron-core's own object is left as it is.

``local_mamba_stack_spec_chunk{C}_conv{K}`` (and the ``te_`` one): the same stack with the Mamba mixer's
chunk size and conv width (no Megatron-LM flag sets them; megatron-core's defaults are 128 and 4), as
``bitdet recipe megatron-args`` renders a recipe's ``model.mamba.chunk_size`` / ``conv_kernel``.
"""
import copy
import dataclasses
import re

from megatron_bitdet.compat import builders
from megatron_bitdet.enforce import audit
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

    spec, _ = swap_grouped_experts(mamba_stack_spec, copy=True)
    globals()[name] = spec
    return spec


def replace_in_spec(spec, position: str, new, *, copy: bool):
    """Put ``new`` at ``position`` of ``spec`` (``ModuleSpec`` and ``partial`` builders stepped through):
    in place (the object Megatron will build from), or in a copy that shares every untouched node with the
    original (``copy=True``); returns the spec."""
    head, _, rest = position.partition(".")
    if builders.is_builder(spec):
        inner = replace_in_spec(builders.submodules_of(spec), position, new, copy=copy)
        return builders.rebuilt(spec, submodules=inner) if copy else spec
    child = new if not rest else replace_in_spec(getattr(spec, head), rest, new, copy=copy)
    if copy:
        return dataclasses.replace(spec, **{head: child})
    setattr(spec, head, child)
    return spec


def deterministic_experts(moe_submodules):
    """bitdet's GroupedProbMLP for the experts of an MoE layer spec, in the experts builder's own shape: a
    SequentialMLP's own submodules and params (GroupedProbMLP is a SequentialMLP), else the submodules
    the layer's shared experts use (the spec's backend)."""
    from megatron.core.transformer.mlp import MLPSubmodules

    from megatron_bitdet.kernels.grouped_mlp import GroupedProbMLP

    experts = moe_submodules.experts
    own = builders.submodules_of(experts)
    if isinstance(own, MLPSubmodules) and audit.name_of(builders.module_of(experts)) == audit.SEQUENTIAL_MLP:
        return builders.rebuilt(experts, module=GroupedProbMLP)
    shared = builders.submodules_of(moe_submodules.shared_experts)
    return builders.rebuilt(experts, module=GroupedProbMLP, submodules=dataclasses.replace(shared))


def swap_grouped_experts(spec, *, copy: bool, sequential: bool = False):
    """Replace every grouped-experts class the catalog knows as nondeterministic (and, with ``sequential``,
    megatron's SequentialMLP: the recipe asked for expert_impl grouped) by GroupedProbMLP; returns the
    spec and (position, was, now) per replacement."""
    done = []
    for finding in audit.by_rule(audit.audit_spec(spec)).get("te_grouped_gemm", []):
        if finding.source or (sequential and finding.runs == audit.SEQUENTIAL_MLP):
            replacement = deterministic_experts(_at(spec, finding.position.rsplit(".", 1)[0]))
            spec = replace_in_spec(spec, finding.position, replacement, copy=copy)
            done.append((finding.position, finding.runs, audit.name_of(builders.module_of(replacement))))
    return spec, done


def _at(spec, position: str):
    """The submodules object at ``position`` (stepping through ``ModuleSpec`` and ``partial`` builders)."""
    node = spec
    for part in position.split("."):
        node = getattr(builders.submodules_of(node) if builders.is_builder(node) else node, part)
    return builders.submodules_of(node) if builders.is_builder(node) else node
