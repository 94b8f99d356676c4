"""Which declared patches a recipe gets, read from the declarations: those whose ``needed_when`` holds
for the recipe and its spec family (in ``order``), then those serving a rule the enforcement resolved
with a swap (by their ``rule``). Adding a swap is a kernel, its declaration and its rule's ``swap``."""
from __future__ import annotations

from megatron_bitdet.compat.patching.apply import applied_patches, apply_patches
from megatron_bitdet.compat.patching.declaration import load_declarations

def declared_ids() -> frozenset:
    """Every patch id in ``patches/``: the swaps enforcement may resolve a rule with."""
    return frozenset(d.id for d in load_declarations())


def swap_patches(swaps) -> list[str]:
    """Every declared patch serving a rule the enforcement resolved with a swap (``swaps``: dicts with
    "id"); a rule may need several (mamba_ssm_nondeterministic: the scan and the gated norm)."""
    rules = {s["id"] for s in swaps}
    return [d.id for d in load_declarations() if d.rule in rules]


def select_patches(recipe, *, family: str, swaps=()) -> list[str]:
    """Patch ids for this recipe. ``swaps`` are the rule outcome's resolved swaps (dicts with "id")."""
    ids = [d.id for d in sorted(load_declarations(), key=lambda d: d.order) if d.needed(recipe, family)]
    ids += [i for i in swap_patches(swaps) if i not in ids]
    return ids


def install(ids) -> list[dict]:
    """Apply the patches ``ids`` not applied yet (idempotent); returns the records of all of ``ids``."""
    have = {p["id"] for p in applied_patches()}
    missing = [i for i in ids if i not in have]
    if missing:
        apply_patches(load_declarations(ids=missing))
    return [p for p in applied_patches() if p["id"] in ids]


def apply_for(recipe, *, family: str, swaps=()) -> list[dict]:
    """Apply the recipe's patches once per process (idempotent); returns the manifest records."""
    return install(select_patches(recipe, family=family, swaps=swaps))
