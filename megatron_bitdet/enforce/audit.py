"""Judge what will run, not the flag that asked for it.

megatron's ``ModuleSpec`` tree is data: :func:`walk_spec` names the module class at every position before
anything is built (a ``functools.partial`` builder too: megatron-core 0.17+ layer specs hold
``partial(Module, submodules=...)`` where 0.16 held ``ModuleSpec(module, submodules)``; a spec with MoE
layers whose experts the walk cannot find is refused), and :func:`walk_built` names the class of every
built module together with the kernel functions a Mamba mixer's forward and backward call (the module globals ``megatron.core.ssm.mamba_mixer``
binds, read as they are when the step runs: a swap's patch included). Both match what they find against
the ``implementations`` of the catalog of known sources (``catalog/known_sources.yaml``): a match is a
known nondeterministic implementation, and the rules judge it (``Facts.runs``) whatever the flags say.

:func:`megatron_lm.specs.swap_grouped_experts` swaps a class the spec itself holds (megatron-core's TE Mamba spec builds its MoE
experts as ``TEGroupedMLP`` when it is imported, whatever ``--moe-grouped-gemm`` says) in the spec object:
a swap replaces what will be built, not a binding the spec no longer reads. :func:`flag_calls` names what
megatron-core picks by a config flag instead (TE's fused router, permute, cross entropy).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from dataclasses import dataclass

from megatron_bitdet.errors import BitdetError

# the rule judging each kind of position: experts, attention core, the Mamba mixer's conv and scan calls
SLOT_RULES = {"experts": ("te_grouped_gemm",), "core_attention": ("te_attention_nondeterministic", "flash_attention"),
              "mixer.conv": ("causal_conv1d_old",), "mixer.scan": ("mamba_ssm_nondeterministic",),
              "config.moe_router_fusion": ("moe_router_fusion",), "config.moe_permute_fusion": ("moe_permute_fusion",),
              "config.cross_entropy_loss_fusion": ("cross_entropy_loss_fusion",)}
# megatron-core 0.16.1 picks these by a config flag, not a spec class: config field -> (what runs when it
# is on, the binding megatron calls when it is off: read as bound now, a swap's patch included)
FLAG_CALLS = {
    "moe_router_fusion": ("megatron.core.extensions.transformer_engine:fused_moe_aux_loss",
                          "megatron.core.transformer.moe.router:switch_load_balancing_loss_func"),
    "moe_permute_fusion": ("megatron.core.extensions.transformer_engine:fused_unpermute",
                           "megatron.core.transformer.moe.moe_utils:unpermute"),
    "cross_entropy_loss_fusion": ("megatron.core.fusions.fused_cross_entropy:fused_vocab_parallel_cross_entropy",
                                  "megatron.core.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy"),
}
# MambaMixer (megatron-core 0.16.1): the memory-efficient path runs one fused conv+scan function with its
# own conv; the split path calls the conv and the chunked scan through these module globals
MIXER_CALLS = {True: {"conv": "mamba_split_conv1d_scan_combined", "scan": "mamba_split_conv1d_scan_combined"},
               False: {"conv": "causal_conv1d_fn", "scan": "mamba_chunk_scan_combined"}}
MIXER_MODULE = "megatron.core.ssm.mamba_mixer"
UNBOUND = {"causal_conv1d_fn": "torch.nn.Conv1d (megatron's fallback: causal_conv1d does not import)"}
TE_WRAPPERS = "megatron.core.extensions.transformer_engine"
GROUPED_PROB_MLP = "megatron_bitdet.kernels.grouped_mlp:GroupedProbMLP"
SEQUENTIAL_MLP = "megatron.core.transformer.moe.experts:SequentialMLP"


@dataclass(frozen=True)
class Finding:
    """What runs at one position: ``source`` is the catalog entry it matches (None: not a known source)."""

    position: str
    runs: str
    source: str | None = None

    def as_dict(self) -> dict:
        return {"position": self.position, "runs": self.runs, "source": self.source}


def _join(path: str, name) -> str:
    return f"{path}.{name}" if path else str(name)


def walk_spec(node, path: str = ""):
    """(position, object) for every module a spec tree names, parents first; nothing is built."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(node, ModuleSpec):
        if path:
            yield path, node.module
        yield from walk_spec(node.submodules, path)
    elif isinstance(node, functools.partial):  # a builder: what it builds, then its submodules
        if path:
            yield path, built_by(node)
        yield from walk_spec(node.keywords.get("submodules"), path)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield from walk_spec(getattr(node, f.name), _join(path, f.name))
    elif isinstance(node, (list, tuple)):
        for i, child in enumerate(node):
            yield from walk_spec(child, _join(path, i))
    elif node is not None and path:
        yield path, node


def built_by(builder: functools.partial):
    """The class a ``partial`` builder builds: its function, or the class of a bound class method
    (``partial(MLP.as_mlp_submodule, ...)``); a plain builder function is named as itself."""
    func = builder.func
    owner = getattr(func, "__self__", None)
    return owner if isinstance(owner, type) else func


def name_of(obj) -> str:
    """``module:qualname``; a TE wrapper that is a placeholder (TE absent) by the name megatron binds it to."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and not module.startswith("unittest.mock"):
        return f"{module}:{qualname}"
    for where in (TE_WRAPPERS, MIXER_MODULE):
        for attr, value in vars(sys.modules.get(where) or object).items():
            if value is obj:
                return f"{where}:{attr}"
    return f"<{type(obj).__name__}>"


@functools.lru_cache(maxsize=None)
def _known() -> tuple:
    """(symbol, object or None, entry id) for every catalog implementation; None: its module does not import."""
    from megatron_bitdet.enforce.catalog import load_catalog

    out = []
    for entry in load_catalog().entries:
        for symbol in entry.implementations:
            module, attr = symbol.split(":")
            try:
                obj = getattr(importlib.import_module(module), attr, None)
            except Exception:  # GPU packages raise more than ImportError without CUDA
                obj = None
            out.append((symbol, obj, entry.id))
    return tuple(out)


def source_of(obj) -> str | None:
    """The catalog entry ``obj`` is an implementation of: the object itself, a subclass, or its name."""
    name = name_of(obj)
    for symbol, known, entry in _known():
        if name == symbol or (known is not None and (obj is known or (
                isinstance(obj, type) and isinstance(known, type) and issubclass(obj, known)))):
            return entry
    return None


def _slot(position: str) -> str | None:
    return next((s for s in SLOT_RULES if position == s or position.endswith(f".{s}")), None)


def mixer_calls(position: str, mem_eff_path: bool) -> list[Finding]:
    """The kernel functions a Mamba mixer at ``position`` calls, as bound now (after any patch)."""
    module = importlib.import_module(MIXER_MODULE)
    out = []
    for kind, attr in MIXER_CALLS[bool(mem_eff_path)].items():
        fn = getattr(module, attr, None)
        runs = name_of(fn) if fn is not None else UNBOUND.get(attr, f"nothing ({attr} unbound: mamba_ssm does not import)")
        out.append(Finding(f"{position}.{kind}", runs, source_of(fn) if fn is not None else None))
    return out


def flag_calls(config) -> list[Finding]:
    """What runs where megatron-core chooses by a flag of ``config`` (a TransformerConfig or Megatron-LM's
    args): the fused kernel when it is on, else megatron's own function as bound now."""
    out = []
    for field_name, (fused, binding) in FLAG_CALLS.items():
        if not hasattr(config, field_name):
            continue
        if getattr(config, field_name):
            out.append(Finding(f"config.{field_name}", fused, _source_by_name(fused)))
        else:
            module, attr = binding.split(":")
            fn = getattr(importlib.import_module(module), attr)
            out.append(Finding(f"config.{field_name}", name_of(fn), source_of(fn)))
    return out


def _source_by_name(symbol: str) -> str | None:
    return next((entry for known, _, entry in _known() if known == symbol), None)


def audit_spec(spec, *, mem_eff_path: bool = True, num_moe_experts: int | None = None) -> list[Finding]:
    """What the spec will build at each judged position, and what its Mamba mixers will call. A spec with
    an MoE layer, or walked for a model with experts (``num_moe_experts``), in which no experts position
    is found is refused: the experts are held where the walk cannot see, never reported clear."""
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    out, moe_layers = [], []
    for position, obj in walk_spec(spec):
        if _slot(position):
            out.append(Finding(position, name_of(obj), source_of(obj)))
        if isinstance(obj, type) and issubclass(obj, MambaMixer):
            out += mixer_calls(position, mem_eff_path)
        if isinstance(obj, type) and issubclass(obj, BaseMoELayer):
            moe_layers.append(position)
    _require_experts(out, f"a spec with MoE layer(s) at {', '.join(moe_layers)}" if moe_layers else
                     f"a spec for a model with num_moe_experts={num_moe_experts}" if num_moe_experts else None)
    return out


def _require_experts(findings, walked: str | None) -> None:
    """``walked`` (what was walked, when it has experts) without an experts position is an error."""
    if walked and not any(_slot(f.position) == "experts" for f in findings):
        raise BitdetError(f"the audit found no MoE experts position in {walked}: what builds the experts "
                          "is held where the walk cannot see, so it cannot be judged (never reported clear)")


def walk_built(modules) -> list[Finding]:
    """The same judgement on built modules (model chunks): every module's class, each mixer's calls."""
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.transformer_config import TransformerConfig

    out = []
    for chunk, model in enumerate(modules):
        for name, module in model.named_modules():
            position, source = _join(f"chunk{chunk}", name), source_of(type(module))
            if _slot(name) or source:
                out.append(Finding(position, name_of(type(module)), source))
            if isinstance(module, MambaMixer):
                out += mixer_calls(position, module.use_mem_eff_path)
    config = next((m.config for model in modules for m in model.modules()
                   if isinstance(getattr(m, "config", None), TransformerConfig)), None)
    return out + (flag_calls(config) if config is not None else [])


def by_rule(findings) -> dict:
    """rule id -> findings of the positions that rule judges (what the manifest records per rule)."""
    out: dict = {}
    for f in findings:
        for rule in SLOT_RULES.get(_slot(f.position), ()):
            out.setdefault(rule, []).append(f)
    return out


def recipe_keys(spec) -> dict:
    """The recipe keys a spec decides whatever the flags say: its family (any TE wrapper: te) and the
    implementation of its MoE experts."""
    family = "te" if any(name_of(obj).startswith(f"{TE_WRAPPERS}:") for _, obj in walk_spec(spec)) else "local"
    out = {"model.spec": family}
    experts = by_rule(audit_spec(spec)).get("te_grouped_gemm", [])
    if experts:
        out["model.moe.expert_impl"] = ("te_grouped" if any(f.source for f in experts) else
                                        "grouped" if all(f.runs == GROUPED_PROB_MLP for f in experts) else "sequential")
    return out


def runs_record(findings) -> dict:
    """rule id -> [{position, runs, source}]: the manifest's record of what will run, per rule."""
    return {rule: [f.as_dict() for f in found] for rule, found in by_rule(findings).items()}
