"""What a Megatron-LM launch line breaks beyond the recipe's rules, judged on Megatron's validated args
(``judging.judge``, with ``--deterministic-mode``), every one at once with the rest:

- ``resume_skips_restore``: a line that resumes (it has ``--load``) with a flag that skips or replaces
  restored state (``RESTORE_FLAGS``, read off ``megatron/training/checkpointing.py`` and ``arguments.py``
  of Megatron-LM core_v0.16.1 and core_v0.19.0): every restart of the job continues from a state the
  uninterrupted run never had. The line accepts it with ``--accept-skipped-restore`` (recorded in the
  manifest as an opt-out; ``bitdet verify-resume --skip-restore`` plants its faults that way).
- ``reductions_not_installed``: ``determinism.reductions: dp_invariant`` on a line it is not installed for
  under Megatron-LM's loop (``virtual_ranks.refusals``: the distributed optimizer, overlap, model
  parallelism, ...): the run would reduce natively there while its manifest claimed DP invariance.

And what the manifest records of how a launch stops (``stop``): a wall-clock or signal stop is accepted
(the steps' bits do not depend on where a launch stops; Megatron agrees the stop step across ranks and saves
there), but the length of such a launch is not a function of its line.
"""
from __future__ import annotations

import os

from megatron_bitdet.enforce.rules import Violation

ACCEPT_FLAG = "--accept-skipped-restore"
RESUME_RULE = "resume_skips_restore"
RESUME_WHY = ("the resumed launch continues from a state the uninterrupted run never had (a fresh optimizer, "
              "warm-up restarted, the seed's RNG streams, step 0 or a rewound data position), so no step after "
              "the restart is bitwise the uninterrupted run's")

# (attribute, when it matters: "load" -- the line loads, "save" -- what it saves is what it loads,
#  flag, what it skips or replaces, the fix)
RESTORE_FLAGS = (
    ("no_load_optim", "load", "--no-load-optim", "the optimizer and the learning-rate scheduler are not restored "
     "(Adam's moments start at zero, the schedule at step 0)", "drop --no-load-optim"),
    ("no_load_rng", "load", "--no-load-rng", "the RNG states (dropout, the data-parallel init) are not restored",
     "drop --no-load-rng"),
    ("finetune", "load", "--finetune", "the iteration is reset to 0 and neither the optimizer, the scheduler, the "
     "RNG nor the data position is restored", "drop --finetune (start a fine-tune from a pretrained model with "
     "--pretrained-checkpoint DIR, which is read only while --load holds no checkpoint)"),
    ("moe_use_upcycling", "load", "--moe-use-upcycling", "Megatron's validate_args turns on --no-load-optim and "
     "--no-load-rng for it", "drop --moe-use-upcycling once the upcycled checkpoint exists (it converts a dense "
     "checkpoint once)"),
    ("override_ckpt_iteration", "load", "--override-ckpt-iteration", "the restored iteration and data position "
     "are replaced (Megatron-LM 0.19)", "drop --override-ckpt-iteration"),
    ("no_save_optim", "save", "--no-save-optim", "the checkpoints this line saves and loads hold no optimizer "
     "state, so the resumed launch builds a fresh one", "drop --no-save-optim"),
    ("no_save_rng", "save", "--no-save-rng", "the checkpoints this line saves and loads hold no RNG state",
     "drop --no-save-rng"),
)
# valueless flags of the family (a workflow drops them without a value)
RESTORE_SWITCHES = tuple(flag for attr, _, flag, _, _ in RESTORE_FLAGS if attr != "override_ckpt_iteration")


def _same_dir(a, b) -> bool:
    return a is not None and b is not None and os.path.abspath(str(a)) == os.path.abspath(str(b))


def skipped_restores(args) -> list[tuple[str, str, str]]:
    """(flag, what it skips, fix) for each restore-skipping flag that takes effect on this line: one that
    skips on load where the line has ``--load``; one that leaves state out of the checkpoints where the line
    loads what it saves (``--save`` and ``--load`` the same folder)."""
    load = getattr(args, "load", None)
    out = []
    for attr, when, flag, what, fix in RESTORE_FLAGS:
        value = getattr(args, attr, None)
        if value is None or value is False:
            continue
        if when == "load" and load is None or when == "save" and not _same_dir(getattr(args, "save", None), load):
            continue
        if attr in ("no_load_optim", "no_load_rng") and getattr(args, "moe_use_upcycling", False):
            continue  # set by validate_args for upcycling: named once, as --moe-use-upcycling
        out.append((flag if value is True else f"{flag} {value}", what, fix))
    return out


def line_judgement(args, recipe) -> tuple[list, list]:
    """(violations, opt-outs as the manifest records them) of the launch line beyond the recipe's rules
    (``recipe``: the run's, or the line's ``--recipe``; None: no recipe, default determinism settings)."""
    violations, opt_outs = [], []
    skipped = skipped_restores(args)
    if skipped:
        message = "the line resumes (--load) with " + "; ".join(f"{flag}: {what}" for flag, what, _ in skipped)
        if getattr(args, "accept_skipped_restore", False):
            opt_outs.append({"id": RESUME_RULE, "message": message, "why": RESUME_WHY,
                             "where": f"the launch line ({ACCEPT_FLAG})"})
        else:
            violations.append(Violation(RESUME_RULE, message, RESUME_WHY,
                                        "; ".join(fix for _, _, fix in skipped)
                                        + f" (or accept it on purpose with {ACCEPT_FLAG})"))
    if recipe is not None and recipe.determinism.reductions == "dp_invariant":
        from megatron_bitdet.megatron_lm.virtual_ranks import WHY, refusals

        refused = refusals(args, recipe)
        if refused:
            violations.append(Violation(
                "reductions_not_installed",
                f"determinism.reductions is dp_invariant ({recipe.where('determinism', 'reductions')}) with "
                + "; ".join(what for what, _ in refused), WHY,
                "; ".join(fix for _, fix in refused) + " (or set determinism.reductions: topology_invariant or "
                "native, or train the recipe with bitdet train)"))
    return violations, opt_outs


def stop_conditions(args) -> list[str]:
    """How a launch of the line stops besides the end of its schedule, as the manifest records it:
    ``wall_clock`` (``--exit-duration-in-mins``), ``signal`` (``--exit-signal-handler``), ``iteration``
    (``--exit-interval``). A launch stopped by the first two has a length that is not a function of its line."""
    out = []
    if getattr(args, "exit_duration_in_mins", None):
        out.append(f"wall_clock: --exit-duration-in-mins {args.exit_duration_in_mins}")
    if getattr(args, "exit_signal_handler", False):
        signal = getattr(args, "exit_signal", None)
        out.append(f"signal: --exit-signal-handler ({getattr(signal, 'name', signal)})")
    if getattr(args, "exit_interval", None):
        out.append(f"iteration: --exit-interval {args.exit_interval}")
    return out
