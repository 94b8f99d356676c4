"""Fixes in the language of a Megatron-LM launch line: a violation a flag of the line decides names the flag
to drop; one the ``--spec`` decides names the spec to pass. The recipe key stays beside it only when a
``--recipe`` was given (the user's line has no recipe keys otherwise)."""
from __future__ import annotations

from megatron_bitdet.enforce.megatron import MEGATRON_FLAG_RULES


def _flash(a) -> bool:
    return bool(getattr(a, "use_flash_attn", False)) or \
        getattr(getattr(a, "attention_backend", None), "name", None) == "flash"


# rule id -> (is the flag on in these args, the launch-line fix)
FLAG_FIXES = {rid: (lambda a, attr=attr: bool(getattr(a, attr, False)), f"drop --{attr.replace('_', '-')}")
              for attr, rid in MEGATRON_FLAG_RULES.items() if rid != "flash_attention"}
FLAG_FIXES["flash_attention"] = (_flash, "drop --use-flash-attn / --attention-backend flash")
# rule id -> the fix when the spec, not a flag, holds the nondeterministic module
SPEC_FIXES = {"te_grouped_gemm": "pass --spec megatron_bitdet.megatron_lm.specs te_mamba_stack_spec (its experts "
                                 "are bitdet's deterministic grouped GEMM), or let bitdet swap them (determinism.swaps)"}


def in_flags(violations, args, recipe_given: bool) -> list:
    """``violations`` with each flag- or spec-decided fix in launch-line terms (and, with ``--recipe``, the
    recipe key after it)."""
    from megatron_bitdet.enforce import Violation

    out = []
    for v in violations:
        on, flag = FLAG_FIXES.get(v.rule_id, (None, None))
        fix = flag if on is not None and on(args) else SPEC_FIXES.get(v.rule_id)
        if fix is not None:
            v = Violation(v.rule_id, v.message, v.why, f"{fix} (in the recipe: {v.fix})" if recipe_given else fix)
        out.append(v)
    return out
