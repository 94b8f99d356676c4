"""The built-model audit judges what will run: megatron-core's own layer specs walked as data (its TE
Mamba spec, its GPT TE layer spec), the swap of what such a spec holds, the one truth of the library
path's swaps, and the recipe checks that keep a spec from failing at build.

Transformer Engine does not import here. Where a test needs what a spec holds *with* TE, a stand-in
replaces exactly the name megatron-core binds only when TE imports; each one is described where it is
made. Everything else is megatron-core's own code and objects.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys

import pytest

from megatron_bitdet.compat import builders, cpu_backend
from megatron_bitdet.enforce import Facts, apply_to_megatron_args, evaluate_rules, megatron_overrides, plan
from megatron_bitdet.errors import BitdetInputError, DeterminismViolation
from megatron_bitdet.recipe import RecipeError, load_recipe

cpu_backend.install()  # megatron's Mamba mixer imports Triton-only helpers at import time

MAMBA_SPECS = "megatron.core.models.mamba.mamba_layer_specs"
HYBRID_SPECS = "megatron.core.models.hybrid.hybrid_layer_specs"
EXPERTS = "moe_layer.mlp.experts"
GROUPED_MLP = "megatron.core.transformer.moe.experts:GroupedMLP"
TE_GROUPED_MLP = "megatron.core.transformer.moe.experts:TEGroupedMLP"
GROUPED_PROB_MLP = "megatron_bitdet.kernels.grouped_mlp:GroupedProbMLP"
SEQUENTIAL_MLP = "megatron.core.transformer.moe.experts:SequentialMLP"


@pytest.fixture(scope="module")
def audit():
    from megatron_bitdet.enforce import audit

    return audit


def tiny(*overrides):
    return load_recipe("nemotron_h_tiny", list(overrides))


def at(findings, position):
    return next(f for f in findings if f.position == position)


class TEGroupedLinearStandIn:
    """Stand-in for TE's ``GroupedLinear`` wrapper: megatron-core binds
    ``transformer_engine_spec_provider.TEColumnParallelGroupedLinear`` to a TE class when TE >= 1.9 imports
    and to None otherwise; only whether it is None decides which experts class the TE provider returns."""


def stand_in_te_grouped_linear(monkeypatch):
    from megatron.core.extensions import transformer_engine_spec_provider as provider

    monkeypatch.setattr(provider, "TEColumnParallelGroupedLinear", TEGroupedLinearStandIn)
    monkeypatch.setattr(provider, "TERowParallelGroupedLinear", TEGroupedLinearStandIn)


@pytest.fixture
def te_mamba_specs(monkeypatch):
    """megatron-core's mamba_layer_specs module executed afresh as it executes with TE installed: the TE
    grouped linear stand-in above is bound where TE's class would be, so ``get_moe_module_spec(use_te=True,
    moe_grouped_gemm=True)`` at its import picks TEGroupedMLP. A private copy: the real module is untouched
    (imported, if it was not, before the stand-in is bound)."""
    real = importlib.import_module(MAMBA_SPECS)
    try:  # from megatron-core 0.18 MAMBA_SPECS re-exports the module that builds the spec
        real = importlib.import_module(HYBRID_SPECS)
    except ModuleNotFoundError:
        pass
    stand_in_te_grouped_linear(monkeypatch)
    spec = importlib.util.spec_from_file_location(f"{MAMBA_SPECS}_with_te", real.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_megatrons_te_mamba_spec_holds_grouped_experts_whatever_the_flags(audit, te_mamba_specs):
    """Why 1: the spec builds its experts at import; the rule judges that class, not --moe-grouped-gemm.
    With TE (the stand-in) it is TEGroupedMLP on every version; without TE, megatron-core before 0.17
    builds the legacy GroupedMLP (refused alike), from 0.17 SequentialMLP on local linears (deterministic:
    clear, and named as what runs)."""
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as cpu_spec

    spec = te_mamba_specs.mamba_stack_spec
    findings = audit.audit_spec(spec, mem_eff_path=False)
    experts = at(findings, EXPERTS)
    assert (experts.runs, experts.source) == (TE_GROUPED_MLP, "grouped_gemm_dprob_atomics")
    assert audit.recipe_keys(spec) == {"model.spec": "te", "model.moe.expert_impl": "te_grouped"}
    recipe = tiny("model.moe.expert_impl=sequential", "determinism.swaps=false")  # what the flags alone say
    assert evaluate_rules(recipe, Facts()).violations == []
    outcome = evaluate_rules(recipe, Facts(runs=audit.by_rule(findings)))
    [violation] = [v for v in outcome.violations if v.rule_id == "te_grouped_gemm"]
    assert violation.message == f"{EXPERTS} is {TE_GROUPED_MLP}"
    assert outcome.runs["te_grouped_gemm"] == [experts.as_dict()]
    cpu = at(audit.audit_spec(cpu_spec), EXPERTS)
    if builders.partial_builders():
        assert (cpu.runs, cpu.source) == (SEQUENTIAL_MLP, None)
        assert audit.recipe_keys(cpu_spec)["model.moe.expert_impl"] == "sequential"
    else:
        assert (cpu.runs, cpu.source) == (GROUPED_MLP, "grouped_gemm_dprob_atomics")
        assert audit.recipe_keys(cpu_spec)["model.moe.expert_impl"] == "te_grouped"
        assert evaluate_rules(recipe, Facts(runs=audit.by_rule(audit.audit_spec(cpu_spec)))).violations


def test_te_stand_in_spec_holds_te_grouped_mlp_and_the_swap_replaces_it(audit, te_mamba_specs):
    """megatron's own TE hybrid spec (the stand-in) is reported with TEGroupedMLP, and the swap puts
    GroupedProbMLP there in the node's own shape (a ``partial`` builder from 0.17) on the shared experts'
    linears: the audit then names what will be built, never the class it replaced."""
    import functools

    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec as cpu_spec

    from megatron_bitdet.megatron_lm import specs

    spec = te_mamba_specs.mamba_stack_spec
    cpu_experts = at(audit.audit_spec(cpu_spec), EXPERTS)
    assert at(audit.audit_spec(spec), EXPERTS).runs == TE_GROUPED_MLP
    copied, done = specs.swap_grouped_experts(spec, copy=True)
    assert done == [(EXPERTS, TE_GROUPED_MLP, GROUPED_PROB_MLP)]
    assert at(audit.audit_spec(copied), EXPERTS) == audit.Finding(EXPERTS, GROUPED_PROB_MLP, None)
    assert at(audit.audit_spec(spec), EXPERTS).runs == TE_GROUPED_MLP  # copy=True leaves the original alone
    moe = builders.submodules_of(copied.submodules.moe_layer.submodules.mlp)
    assert isinstance(moe.experts, functools.partial) is builders.partial_builders()
    shared, experts = builders.submodules_of(moe.shared_experts), builders.submodules_of(moe.experts)
    assert (experts.linear_fc1, experts.linear_fc2) == (shared.linear_fc1, shared.linear_fc2)
    assert copied.submodules.mamba_layer is spec.submodules.mamba_layer  # untouched nodes are shared
    in_place, _ = specs.swap_grouped_experts(spec, copy=False)  # what Megatron will build from
    assert in_place is spec and at(audit.audit_spec(spec), EXPERTS).runs == GROUPED_PROB_MLP
    assert at(audit.audit_spec(cpu_spec), EXPERTS) == cpu_experts  # the real module was never touched


def test_gpt_te_layer_spec_walked_as_data(audit, monkeypatch):
    """megatron-core's GPT TE layer spec: TE attention is judged by the env, the experts by their class.
    Stand-ins: ``gpt_layer_specs`` binds ``TESpecProvider``, ``TENorm`` and ``TEFusedMLP`` only when
    ``import transformer_engine`` succeeds; they are bound here to megatron-core's own objects of those
    names (its TE wrappers module imports without TE, its classes then placeholders). megatron-core caches
    TE's ``__version__`` in ``megatron.core.utils._te_version`` when TE imports; the stand-in is 2.8.0.
    TE's grouped linear: the stand-in above (the experts are then TEGroupedMLP on every version)."""
    from megatron.core import utils as mcore_utils
    from megatron.core.extensions import transformer_engine as te_wrappers
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
    from megatron.core.models.gpt import gpt_layer_specs
    from packaging.version import Version

    monkeypatch.setattr(mcore_utils, "_te_version", Version("2.8.0"))
    stand_in_te_grouped_linear(monkeypatch)

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", TESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te_wrappers.TENorm, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TEFusedMLP", te_wrappers.TEFusedMLP, raising=False)
    spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
    findings = audit.audit_spec(spec)
    attention = at(findings, "self_attention.core_attention")
    assert (attention.runs, attention.source) == (f"{audit.TE_WRAPPERS}:TEDotProductAttention", "te_attention_atomics")
    experts = at(findings, "mlp.experts")
    assert (experts.runs, experts.source) == (TE_GROUPED_MLP, "grouped_gemm_dprob_atomics")
    assert audit.recipe_keys(spec) == {"model.spec": "te", "model.moe.expert_impl": "te_grouped"}
    recipe = tiny("model.spec=local")  # the flags' view: no TE attention
    runs = audit.by_rule(findings)
    fired = {nvte: [v.message for v in evaluate_rules(recipe, Facts(
        env={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": nvte}, runs=runs)).violations
        if v.rule_id == "te_attention_nondeterministic"] for nvte in ("0", "1")}
    assert fired["0"] == []
    assert fired["1"] == [f"self_attention.core_attention is {audit.TE_WRAPPERS}:TEDotProductAttention with "
                          "NVTE_ALLOW_NONDETERMINISTIC_ALGO='1'"]


def test_te_mamba_stack_spec_target_is_megatrons_spec_with_deterministic_experts(audit, te_mamba_specs, monkeypatch):
    """``--spec megatron_bitdet.megatron_lm.specs te_mamba_stack_spec`` where TE imports (the stand-in
    spec module in megatron's place): megatron's spec with only its experts swapped."""
    from megatron_bitdet.megatron_lm import specs

    monkeypatch.setitem(sys.modules, MAMBA_SPECS, te_mamba_specs)
    monkeypatch.setattr(specs, "te_mamba_stack_spec", None, raising=False)
    monkeypatch.delattr(specs, "te_mamba_stack_spec")  # built afresh from the stand-in; restored after
    theirs = te_mamba_specs.mamba_stack_spec
    ours = specs.te_mamba_stack_spec
    walked = dict(audit.walk_spec(ours)), dict(audit.walk_spec(theirs))
    differ = sorted(p for p in walked[0].keys() | walked[1].keys() if walked[0].get(p) is not walked[1].get(p))
    assert differ == [EXPERTS, f"{EXPERTS}.linear_fc1", f"{EXPERTS}.linear_fc2"]  # nothing else changed
    assert audit.recipe_keys(ours) == {"model.spec": "te", "model.moe.expert_impl": "grouped"}
    assert at(audit.audit_spec(theirs), EXPERTS).runs == TE_GROUPED_MLP


def as_builders(node):
    """A spec in megatron-core 0.17+'s shape: every ``ModuleSpec(module, params, submodules)`` below the
    top becomes ``functools.partial(module, submodules=..., **params)``, as its layer specs now hold."""
    import dataclasses
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(node, ModuleSpec):
        return functools.partial(node.module, submodules=as_builders(node.submodules), **node.params)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return dataclasses.replace(node, **{f.name: as_builders(getattr(node, f.name))
                                            for f in dataclasses.fields(node) if f.init})
    return node


def test_partial_builders_are_walked_like_module_specs(audit, te_mamba_specs):
    """The TE stand-in spec with every node a ``partial`` builder: the same positions, classes and
    verdicts, its grouped experts reported as TE's, never clear."""
    spec = te_mamba_specs.mamba_stack_spec
    built = spec.__class__(module=spec.module, params=spec.params, submodules=as_builders(spec.submodules))
    assert built.submodules.moe_layer.func.__name__ == "MoETransformerLayer"  # really partials now
    assert [(f.position, f.runs, f.source) for f in audit.audit_spec(built)] == \
        [(f.position, f.runs, f.source) for f in audit.audit_spec(spec)]
    experts = at(audit.audit_spec(built), EXPERTS)
    assert (experts.runs, experts.source) == (TE_GROUPED_MLP, "grouped_gemm_dprob_atomics")
    assert audit.recipe_keys(built) == {"model.spec": "te", "model.moe.expert_impl": "te_grouped"}


def with_submodules(node, **changes):
    """``node`` (a ModuleSpec, or a 0.17+ partial builder) with some of its submodules' fields replaced."""
    import dataclasses
    import functools

    if isinstance(node, functools.partial):
        return functools.partial(node.func, *node.args, **{
            **node.keywords, "submodules": dataclasses.replace(node.keywords["submodules"], **changes)})
    return dataclasses.replace(node, submodules=dataclasses.replace(node.submodules, **changes))


def test_a_spec_walk_finding_no_experts_is_an_error(audit):
    """An MoE layer whose experts the walk cannot see, or a model with experts whose spec shows no
    experts position (here its MoE layer is built by an opaque function), is refused, not passed."""
    import functools

    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_bitdet.errors import BitdetError

    def moe_builder(**kwargs):
        return MoELayer(**kwargs)

    layer = mamba_stack_spec.submodules.moe_layer
    mlp = layer.submodules.mlp
    for mlp, num_moe_experts, where in ((with_submodules(mlp, experts=None), None, r"MoE layer\(s\) at moe_layer.mlp:"),
                                        (functools.partial(moe_builder), 4, "num_moe_experts=4")):
        spec = with_submodules(mamba_stack_spec, moe_layer=with_submodules(layer, mlp=mlp))
        with pytest.raises(BitdetError, match="the audit found no MoE experts position in .*" + where):
            audit.audit_spec(spec, num_moe_experts=num_moe_experts)
    assert not any(f.position == EXPERTS for f in audit.audit_spec(spec))  # without the count: nothing to hold it to


def test_mem_eff_path_is_routed_to_the_split_path_the_swaps_reach():
    """Why 3: megatron's default use_mamba_mem_eff_path calls mamba_split_conv1d_scan_combined, whose
    own conv the causal_conv1d swap cannot reach; deterministic mode takes the split path, where it can."""
    from megatron.core.transformer import TransformerConfig

    from megatron_bitdet.compat.patching import load_declarations, patched

    recipe = tiny()
    overrides = megatron_overrides(recipe, swapped=["causal_conv1d_old"])
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, **{
        k: v for k, v in overrides.items() if k != "moe_grouped_gemm"})
    assert config.use_mamba_mem_eff_path is False
    args = apply_to_megatron_args(argparse.Namespace(), recipe)
    assert args.use_mamba_mem_eff_path is False  # core_transformer_config_from_args copies it into the config
    from megatron_bitdet.enforce import audit

    with patched(load_declarations(ids=["causal_conv1d"])):
        calls = {f.position: f.runs for f in audit.mixer_calls("mixer", config.use_mamba_mem_eff_path)}
        assert calls["mixer.conv"] == "megatron_bitdet.kernels.causal_conv1d:causal_conv1d_fn"
        fused = {f.position: f.runs for f in audit.mixer_calls("mixer", True)}
        assert fused["mixer.conv"] != calls["mixer.conv"]  # the fused path would bypass the swap


def test_megatron_overrides_switch_off_what_enable_reports_swapped():
    """Why 4: the README's TransformerConfig(..., **megatron_overrides(recipe)) gets the swaps enable() reports."""
    recipe = tiny("model.moe.router_fusion=true", "model.moe.expert_impl=te_grouped")
    swapped = {s["id"] for s in plan(recipe, environ={}, late=False)[1].swaps}
    assert {"moe_router_fusion", "te_grouped_gemm"} <= swapped
    overrides = megatron_overrides(recipe)
    assert overrides["moe_router_fusion"] is False and overrides["moe_grouped_gemm"] is False
    refused = tiny("model.moe.router_fusion=true", "determinism.swaps=false")
    with pytest.raises(DeterminismViolation, match=r"\[moe_router_fusion\]"):
        megatron_overrides(refused)
    kept = tiny("model.moe.router_fusion=true", "determinism.swaps=false", "determinism.opt_out=[moe_router_fusion]")
    assert megatron_overrides(kept)["moe_router_fusion"] is True


def test_apply_to_megatron_args_swaps_what_enable_swaps_and_refuses_flash():
    args = apply_to_megatron_args(argparse.Namespace(moe_router_fusion=True, moe_grouped_gemm=True))
    assert (args.moe_router_fusion, args.moe_grouped_gemm, args.deterministic_mode) == (False, False, True)
    from megatron.core.transformer.enums import AttnBackend

    with pytest.raises(DeterminismViolation, match=r"\[flash_attention\] --use-flash-attn is set"):
        apply_to_megatron_args(argparse.Namespace(use_flash_attn=True, moe_router_fusion=True))
    with pytest.raises(DeterminismViolation, match=r"\[flash_attention\] --attention-backend flash is set"):
        apply_to_megatron_args(argparse.Namespace(attention_backend=AttnBackend.flash))
    assert apply_to_megatron_args(argparse.Namespace(attention_backend=AttnBackend.auto)).deterministic_mode
    with pytest.raises(DeterminismViolation, match=r"\[moe_router_fusion\]"):
        apply_to_megatron_args(argparse.Namespace(moe_router_fusion=True), tiny("determinism.swaps=false"))


def test_te_fp8_with_grouped_experts_is_refused_at_validation_naming_both_keys():
    """Why 5: GroupedProbMLP refuses config.fp8, so TE FP8 + expert_impl grouped could only fail at build."""
    for override in ("model.spec=te", "model.fp8.implementation=te"):
        with pytest.raises(RecipeError) as err:
            load_recipe("nemotron_h_tiny_fp8", [override])
        text = str(err.value)
        assert "model.moe.expert_impl" in text and "model.fp8.recipe: delayed" in text
    assert load_recipe("nemotron_h_tiny_fp8").model.moe.expert_impl == "grouped"  # emulated FP8 here: builds
    load_recipe("nemotron_h_tiny_fp8", ["model.spec=te", "model.moe.expert_impl=sequential"])


def test_triton_grouped_backend_is_a_recipe_key_refused_where_it_cannot_run(monkeypatch):
    """Why 9: the Triton grouped MLP is selected by model.moe.grouped_backend. Stand-in for a machine with
    triton and a CUDA device: kernels.grouped_mlp.backend_unavailable (bitdet's own check) says nothing is
    missing; the experts spec then carries the backend to GroupedProbMLP."""
    from megatron_bitdet.kernels import grouped_mlp
    from megatron_bitdet.model.builder import stack_spec

    recipe = tiny("model.spec=local", "model.moe.grouped_backend=triton")
    with pytest.raises(BitdetInputError, match=r"model.moe.grouped_backend: triton cannot run here: "):
        stack_spec(recipe)
    with pytest.raises(RecipeError, match=r"model.moe.grouped_backend"):
        tiny("model.moe.expert_impl=sequential", "model.moe.grouped_backend=triton")
    def experts(spec):  # a ModuleSpec before megatron-core 0.17, a partial builder from 0.17
        return builders.submodules_of(spec.submodules.moe_layer.submodules.mlp).experts

    assert "kernel_config" not in builders.params_of(experts(stack_spec(tiny("model.spec=local"))))
    monkeypatch.setattr(grouped_mlp, "backend_unavailable", lambda backend: None)
    built = experts(stack_spec(recipe))
    assert builders.module_of(built) is grouped_mlp.GroupedProbMLP
    assert builders.params_of(built)["kernel_config"] == grouped_mlp.GroupedMLPConfig(backend="triton")


def test_catalog_implementations_name_real_megatron_symbols(audit):
    """A catalog symbol in megatron-core must exist, so a renamed class cannot silently stop matching
    (a TE wrapper exists as None where TE does not import: megatron binds the name either way). The one
    exception is the legacy GroupedMLP, gone from megatron-core 0.17 (the catalog keeps it for 0.16.1)."""
    missing = [symbol for symbol, _, _ in audit._known() if symbol.startswith("megatron.") and
               not hasattr(importlib.import_module(symbol.split(":")[0]), symbol.split(":")[1])]
    assert missing == ([GROUPED_MLP] if builders.partial_builders() else [])


def test_flag_chosen_kernels_are_named_as_bound(audit):
    """Where megatron picks by a flag, the audit names the fused kernel or the function bound now."""
    from megatron_bitdet.compat.patching import load_declarations, patched

    with patched(load_declarations(ids=["moe_aux_loss"])):
        calls = {f.position: (f.runs, f.source) for f in audit.flag_calls(
            argparse.Namespace(moe_router_fusion=False, moe_permute_fusion=True))}
    assert calls == {
        "config.moe_router_fusion": ("megatron_bitdet.kernels.moe_aux:switch_load_balancing_loss_func", None),
        "config.moe_permute_fusion": (f"{audit.TE_WRAPPERS}:fused_unpermute", "moe_fused_permute")}
