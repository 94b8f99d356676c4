"""The hybrid MambaModel built in-process from the tiny recipe (1-rank gloo world, local spec):
repeatable bit for bit, the Mamba mixer runs on bitdet's kernels, the patch selection is right."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import RECIPE
from megatron_bitdet.compat import cpu_backend, patching
from megatron_bitdet.compat.patching import applied_patches, revert_patches
from megatron_bitdet.compat.patching.select import select_patches
from megatron_bitdet.recipe import load_recipe

EXPECTED_PATCHES = ["local_final_norm", "ssd_scan", "gated_rmsnorm", "causal_conv1d", "moe_aux_loss",
                    "grouped_gemm_dprob"]


def _recipe(*overrides):
    return load_recipe(str(RECIPE), ["parallel.expert=1", *overrides])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The model as ``train.setup`` builds it, in this process; every global undone afterwards."""
    from megatron.core import parallel_state as ps

    from megatron_bitdet.model.builder import default_model_provider, transformer_config
    from megatron_bitdet.train.setup import init_parallel, set_seeds

    recipe = _recipe()
    cpu_backend.install()
    before = {p["id"] for p in applied_patches()}
    records = patching.apply_for(recipe, family="local")
    owns_group = not dist.is_initialized()
    if owns_group:
        store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # as enforcement does in a run (embedding backward needs it)
    init_parallel(recipe)
    set_seeds(recipe.training.seed)
    model = default_model_provider(recipe, transformer_config(recipe))
    try:
        yield recipe, model, records
    finally:
        ps.destroy_model_parallel()
        torch.use_deterministic_algorithms(deterministic)
        if owns_group:
            dist.destroy_process_group()
        revert_patches([r["id"] for r in records if r["id"] not in before])


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _forward_backward(model, tokens, rng):
    """One forward+backward from a fixed RNG state; returns the output and every grad as bytes."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.set_rng_state(rng["torch"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in rng["tracker"].items()})
    model.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    out = model(tokens, positions, None, labels=torch.roll(tokens, -1, dims=1))
    out.float().mean().backward()
    grads = {name: _bits(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    return _bits(out), grads


@pytest.mark.timeout(120)
def test_forward_backward_is_bitwise_repeatable(hybrid):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    recipe, model, _ = hybrid
    tokens = torch.randint(0, recipe.model.vocab_size, (2, recipe.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    rng = {"torch": torch.get_rng_state(), "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}
    out_a, grads_a = _forward_backward(model, tokens, rng)
    out_b, grads_b = _forward_backward(model, tokens, rng)
    assert len(grads_a) == sum(1 for p in model.parameters() if p.requires_grad)  # every parameter got a grad
    assert out_a == out_b
    assert [n for n in grads_a if grads_a[n] != grads_b.get(n)] == []


def test_mamba_mixer_runs_on_bitdet_kernels(hybrid):
    """The mixer's kernel bindings are bitdet's and its SSM-only parameters (reached only through
    the conv + scan path) received nonzero grads in the forward+backward above or here."""
    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.mamba_mixer import MambaMixer

    from megatron_bitdet.kernels import causal_conv1d, gated_rmsnorm, ssd

    recipe, model, _ = hybrid
    assert mamba_mixer.mamba_chunk_scan_combined is ssd.ssd_chunk_scan_combined
    assert mamba_mixer.causal_conv1d_fn is causal_conv1d.causal_conv1d_fn
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    assert len(mixers) == recipe.model.hybrid_pattern.count("M")
    assert all(isinstance(m.norm, gated_rmsnorm.GatedRMSNorm) for m in mixers)
    tokens = torch.randint(0, recipe.model.vocab_size, (1, recipe.model.seq_length),
                           generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    out = model(tokens, torch.arange(tokens.shape[1])[None], None, labels=tokens)
    assert torch.isfinite(out).all()
    out.mean().backward()
    for mixer in mixers:
        # the conv's weight and bias: an nn.Conv1d's before megatron-core 0.19, the mixer's own from 0.19
        conv = [n for n, _ in mixer.named_parameters() if n.startswith("conv1d")]
        assert len(conv) == 2, conv
        for name in ("A_log", "D", "dt_bias", *conv):
            grad = mixer.get_parameter(name).grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_built_model_audit_names_what_runs(hybrid):
    """After the build: every judged position of the built model, and the kernels each mixer calls."""
    from megatron_bitdet.enforce import plan
    from megatron_bitdet.enforce.audit import by_rule, walk_built

    recipe, model, _ = hybrid
    runs = {rule: {f.position: f.runs for f in found} for rule, found in by_rule(walk_built([model])).items()}
    moe_layers = [i for i, s in enumerate(recipe.model.hybrid_pattern) if s == "E"]
    assert runs["te_grouped_gemm"] == {f"chunk0.decoder.layers.{i}.mlp.experts":
                                       "megatron_bitdet.kernels.grouped_mlp:GroupedProbMLP" for i in moe_layers}
    assert set(runs["causal_conv1d_old"].values()) == {"megatron_bitdet.kernels.causal_conv1d:causal_conv1d_fn"}
    assert set(runs["mamba_ssm_nondeterministic"].values()) == {"megatron_bitdet.kernels.ssd:ssd_chunk_scan_combined"}
    assert set(runs["te_attention_nondeterministic"].values()) == {
        "megatron.core.transformer.dot_product_attention:DotProductAttention"}
    assert plan(recipe, environ={}, late=False, runs=by_rule(walk_built([model])))[2] == []


def test_built_model_audit_refuses_a_known_source_it_finds():
    """A built module of a catalog class is judged as the class, whatever the recipe says. Stand-in:
    megatron's TEGroupedMLP needs Transformer Engine to be constructed, so the built instance is a
    TEGroupedMLP subclass initialized as a bare torch Module (its class is what is judged)."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron_bitdet.enforce import plan
    from megatron_bitdet.enforce.audit import by_rule, walk_built

    class BuiltGroupedMLP(TEGroupedMLP):
        def __init__(self):
            torch.nn.Module.__init__(self)

    model = torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict({"experts": BuiltGroupedMLP()})})
    [found] = by_rule(walk_built([model]))["te_grouped_gemm"]
    assert (found.position, found.source) == ("chunk0.mlp.experts", "grouped_gemm_dprob_atomics")
    violations = plan(_recipe("model.moe.expert_impl=sequential", "determinism.swaps=false"), environ={},
                      late=False, runs=by_rule(walk_built([model])))[2]
    assert [v.rule_id for v in violations] == ["te_grouped_gemm"]
    assert "chunk0.mlp.experts is test_model:" in violations[0].message


def test_applied_patches_are_the_selected_ones(hybrid):
    _, _, records = hybrid
    assert [r["id"] for r in records] == EXPECTED_PATCHES


@pytest.mark.parametrize("overrides, expected", [
    ((), EXPECTED_PATCHES),
    (("determinism.mode=false",), [p for p in EXPECTED_PATCHES if p != "moe_aux_loss"]),
    (("model.moe.expert_impl=sequential",), [p for p in EXPECTED_PATCHES if p != "grouped_gemm_dprob"]),
    (('model.hybrid_pattern="*-*-"',), ["local_final_norm"]),  # no Mamba, no MoE layer
])
def test_patch_selection_follows_the_recipe(overrides, expected):
    assert select_patches(_recipe(*overrides), family="local") == expected


def test_provider_that_turns_determinism_off_is_refused(hybrid):
    """The deterministic flag is checked again after the model provider ran (user code, after enforcement)."""
    from megatron_bitdet.errors import BitdetInputError
    from megatron_bitdet.model.builder import default_model_provider, transformer_config
    from megatron_bitdet.train.setup import build_model

    recipe = hybrid[0]

    def careless_provider(recipe, config, *, pre_process=True, post_process=True):
        torch.use_deterministic_algorithms(False)  # e.g. a script's "speed-up" line
        return default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)

    try:
        with pytest.raises(BitdetInputError, match=r"careless_provider: after it ran, "
                                                   r"torch.use_deterministic_algorithms is off"):
            build_model(recipe, transformer_config(recipe), careless_provider)
    finally:
        torch.use_deterministic_algorithms(True)


def test_te_family_swaps_the_gated_rmsnorm_in_deterministic_mode():
    """mamba_ssm's Triton gated norm sums dw over a device-dependent number of row blocks: the TE family
    gets bitdet's norm in deterministic mode (the local family always has it)."""
    assert "gated_rmsnorm" in select_patches(_recipe(), family="te")
    assert "gated_rmsnorm" not in select_patches(_recipe("determinism.mode=false"), family="te")
