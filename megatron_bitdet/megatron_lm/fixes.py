"""Fixes in the language of a Megatron-LM launch line: a violation whose rule a flag decides names the flag
to drop (or change); the recipe key stays beside it only when a ``--recipe`` was given (the user's line
has no recipe keys otherwise)."""
from __future__ import annotations

from megatron_bitdet.enforce.megatron import MEGATRON_FLAG_RULES

# rule id -> the launch-line fix, where a flag decides the rule
FLAG_FIXES = {rid: f"drop --{attr.replace('_', '-')}" for attr, rid in MEGATRON_FLAG_RULES.items()}
FLAG_FIXES["flash_attention"] = "drop --use-flash-attn / --attention-backend flash"


def in_flags(violations, recipe_given: bool) -> list:
    """``violations`` with each flag-decided fix naming the flag (and, with ``--recipe``, the recipe key)."""
    from megatron_bitdet.enforce import Violation

    out = []
    for v in violations:
        flag = FLAG_FIXES.get(v.rule_id)
        if flag is not None:
            v = Violation(v.rule_id, v.message, v.why, f"{flag} (in the recipe: {v.fix})" if recipe_given else flag)
        out.append(v)
    return out
