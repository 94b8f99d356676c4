"""Seams into Megatron: TransformerConfig kwargs, a Megatron-LM args Namespace, ``extra_args_provider``.

``deterministic_mode`` must reach megatron-core before the model is built (the vocab embedding and TE
attention read it in ``__init__``), so builders pass ``megatron_overrides(recipe)`` into TransformerConfig.
"""
from __future__ import annotations

from megatron_bitdet.enforce.rules import RULES_BY_ID, Violation
from megatron_bitdet.errors import DeterminismViolation

# Megatron-LM argument / TransformerConfig field -> the bitdet rule that refuses it when true
MEGATRON_FLAG_RULES = {
    "cross_entropy_loss_fusion": "cross_entropy_loss_fusion",
    "tp_comm_overlap": "tp_comm_overlap",
    "moe_router_fusion": "moe_router_fusion",
    "moe_permute_fusion": "moe_permute_fusion",
    "moe_grouped_gemm": "te_grouped_gemm",
    "use_flash_attn": "flash_attention",
}
# rules Megatron-LM's own validate_args asserts in deterministic mode (core_v0.16.1 arguments.py): an
# opt-out cannot make such a launch line run
MEGATRON_LM_ASSERTS = {
    "cross_entropy_loss_fusion": "Cross Entropy Fusion is currently not deterministic.",
    "flash_attention": "Flash attention can not be used in deterministic mode.",
}


def _resolve(rid: str, determinism) -> str:
    from megatron_bitdet.compat.patching import declared_ids
    from megatron_bitdet.enforce.rules import resolution

    return resolution(RULES_BY_ID[rid], determinism, declared_ids())


def _refuse(outcomes) -> None:
    bad = [Violation(rid, message, RULES_BY_ID[rid].why, RULES_BY_ID[rid].fix)
           for rid, (message, how) in outcomes.items() if how == "refuse"]
    if bad:
        raise DeterminismViolation(bad)


def megatron_overrides(recipe, swapped=None) -> dict:
    """TransformerConfig kwargs carrying the recipe's determinism decisions into megatron-core, resolved
    as enable() resolves them: a feature whose rule a swap resolves is switched off (the deterministic
    variant takes its place), an opted-out one stays on, a refused one raises DeterminismViolation.
    ``swapped`` (default: what enable() resolves here) narrows the swaps to an enforcement's own.
    A Mamba mixer takes the split path: the memory-efficient path's fused function runs its own conv
    backward, which neither the causal_conv1d swap nor the rule on the conv can reach."""
    from megatron_bitdet.enforce.facts import Facts

    moe, mode = recipe.model.moe, bool(recipe.determinism.mode)
    outcomes = {}
    for rid in dict.fromkeys(MEGATRON_FLAG_RULES.values()) if mode else ():
        message = RULES_BY_ID[rid].detects(recipe, Facts())
        if message:
            how = _resolve(rid, recipe.determinism)
            outcomes[rid] = (message, "refuse" if how == "swap" and swapped is not None and rid not in swapped
                             else how)
    _refuse(outcomes)
    on = {rid for rid, (_, how) in outcomes.items() if how == "swap"}
    overrides = {
        "deterministic_mode": mode,
        "cross_entropy_loss_fusion": recipe.model.cross_entropy_loss_fusion,
        "tp_comm_overlap": recipe.parallel.tp_comm_overlap,
        "moe_router_fusion": moe.router_fusion and "moe_router_fusion" not in on,
        "moe_permute_fusion": moe.permute_fusion,
        "moe_grouped_gemm": moe.expert_impl == "te_grouped" and "te_grouped_gemm" not in on,
    }
    if mode and recipe.model.has("M"):
        overrides["use_mamba_mem_eff_path"] = False
    return overrides


def apply_to_megatron_args(args, recipe=None):
    """Set ``args.deterministic_mode`` on a Megatron-LM Namespace and resolve every flag without a
    deterministic path as enable() does: swapped (the flag switched off; enable() installs the variant),
    opted out (kept), or refused (DeterminismViolation, every one at once). Mamba mixers take the split
    path (see :func:`megatron_overrides`). Returns args."""
    from megatron_bitdet.recipe.schema import DeterminismConfig

    determinism = recipe.determinism if recipe is not None else DeterminismConfig()
    flags = {rid: (flag, f"--{flag.replace('_', '-')} is set")
             for flag, rid in MEGATRON_FLAG_RULES.items() if getattr(args, flag, False)}
    backend = getattr(args, "attention_backend", None)
    if getattr(backend, "name", backend) == "flash":  # Megatron-LM parses it into megatron's AttnBackend enum
        flags.setdefault("flash_attention", (None, "--attention-backend flash is set"))
    outcomes = {rid: (message, _resolve(rid, determinism)) for rid, (_, message) in flags.items()}
    _refuse(outcomes)
    for rid, (_, how) in outcomes.items():
        if how == "swap":
            setattr(args, flags[rid][0], False)
    args.deterministic_mode = True
    args.use_mamba_mem_eff_path = False
    return args


def add_args(parser):
    """Megatron-LM ``extra_args_provider``: adds a 'bitdet' argument group; takes and returns the parser.
    ``--deterministic-mode`` is Megatron-LM's own flag; it is only added when the parser lacks it."""
    group = parser.add_argument_group(title="bitdet", description="bitwise-deterministic pretraining")
    if "--deterministic-mode" not in parser._option_string_actions:
        group.add_argument("--deterministic-mode", action="store_true",
                           help="apply the canonical environment, torch deterministic algorithms and the rules")
    group.add_argument("--recipe", default=None, metavar="RECIPE", help="bitdet recipe to validate and enforce: a shipped recipe's name (e.g. nemotron_h_tiny) or a recipe YAML file")
    group.add_argument("--bitdet-override", action="append", default=[], metavar="KEY=VALUE",
                       help="override a recipe key, e.g. model.hidden_size=128 (repeatable)")
    return parser
