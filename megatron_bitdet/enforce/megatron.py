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
}


def megatron_overrides(recipe, swapped=()) -> dict:
    """TransformerConfig kwargs that carry the recipe's determinism decisions into megatron-core.
    ``swapped``: rule ids resolved by a swap — their megatron feature is switched off, because the
    deterministic variant (patched in) takes its place."""
    moe, swapped = recipe.model.moe, set(swapped)
    return {
        "deterministic_mode": bool(recipe.determinism.mode),
        "cross_entropy_loss_fusion": recipe.model.cross_entropy_loss_fusion,
        "tp_comm_overlap": recipe.parallel.tp_comm_overlap,
        "moe_router_fusion": moe.router_fusion and "moe_router_fusion" not in swapped,
        "moe_permute_fusion": moe.permute_fusion,
        "moe_grouped_gemm": moe.expert_impl == "te_grouped" and "te_grouped_gemm" not in swapped,
    }


def apply_to_megatron_args(args, recipe=None):
    """Set ``args.deterministic_mode`` on a Megatron-LM Namespace; refuse flags without a deterministic
    path (upstream's asserts plus bitdet's), unless the recipe opts out of the rule. Returns args."""
    opted = set(recipe.determinism.opt_out) if recipe is not None else set()
    bad = [Violation(rid, f"--{flag.replace('_', '-')} is set", RULES_BY_ID[rid].why, f"drop --{flag.replace('_', '-')}")
           for flag, rid in MEGATRON_FLAG_RULES.items() if getattr(args, flag, False) and rid not in opted]
    if bad:
        raise DeterminismViolation(bad)
    args.deterministic_mode = True
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
