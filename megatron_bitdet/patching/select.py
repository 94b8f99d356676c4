"""Which declared patches a recipe gets: the swaps the rules resolved, plus what its layer spec needs."""
from __future__ import annotations

from megatron_bitdet.errors import BitdetError
from megatron_bitdet.patching.apply import applied_patches, apply_patches
from megatron_bitdet.patching.declaration import load_declarations

SSM_PATCHES = ("ssd_scan", "gated_rmsnorm", "causal_conv1d")


def fp8_implementation(recipe, *, family: str) -> str | None:
    """None (no FP8), "te" (Transformer Engine's recipe, TE spec) or "emulated" (the local spec's
    emulated FP8 linears, patch ``fp8_emulated_linear``)."""
    fp8 = recipe.model.fp8
    if fp8.recipe == "none":
        return None
    impl = fp8.implementation if fp8.implementation != "auto" else ("te" if family == "te" else "emulated")
    if (impl == "te") != (family == "te"):
        raise BitdetError(f"model.fp8.implementation={impl} needs model.spec={'te' if impl == 'te' else 'local'} "
                          f"(the resolved spec is {family})")
    return impl


def declared_ids() -> frozenset:
    """Every patch id in ``patches/``: the swaps enforcement may resolve a rule with."""
    return frozenset(d.id for d in load_declarations())


def select_patches(recipe, *, family: str, swaps=()) -> list[str]:
    """Patch ids for this recipe. ``swaps`` are the rule outcome's resolved swaps (dicts with "swap")."""
    ids = ["local_final_norm"] if family == "local" else []
    if recipe.model.has("M") and family == "local":
        ids += SSM_PATCHES  # the local spec's Mamba kernels are ours, in both modes
    if recipe.model.has("E") and recipe.determinism.mode:
        ids.append("moe_aux_loss")
    if recipe.model.has("E") and recipe.model.moe.expert_impl == "grouped":
        ids.append("grouped_gemm_dprob")
    if fp8_implementation(recipe, family=family) == "emulated":
        ids.append("fp8_emulated_linear")
    for s in swaps:
        if s["swap"] not in ids:
            ids.append(s["swap"])
    return ids


def apply_for(recipe, *, family: str, swaps=()) -> list[dict]:
    """Apply the recipe's patches once per process (idempotent); returns the manifest records."""
    wanted = select_patches(recipe, family=family, swaps=swaps)
    have = {p["id"] for p in applied_patches()}
    missing = [i for i in wanted if i not in have]
    if missing:
        apply_patches(load_declarations(ids=missing))
    return [p for p in applied_patches() if p["id"] in wanted]
