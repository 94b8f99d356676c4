"""``enable()``: validate everything first, refuse all violations together, then mutate process state."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from megatron_bitdet.enforce.env import ENV_BY_NAME, effective_env, resolve_env
from megatron_bitdet.enforce.facts import collect_facts
from megatron_bitdet.enforce.late import late_application
from megatron_bitdet.enforce.rules import RuleOutcome, Violation, evaluate_rules
from megatron_bitdet.errors import DeterminismViolation


@dataclass
class Enforcement:
    """What enable() applied: env settings (value + source), rule outcome, torch flags, warnings."""

    mode: bool
    env: dict = field(default_factory=dict)
    rules: RuleOutcome = field(default_factory=RuleOutcome)
    torch: dict = field(default_factory=dict)
    threads: int = 0
    warnings: list = field(default_factory=list)
    patches: list = field(default_factory=list)  # records of the patches installed for rules.swaps


def plan(recipe, environ=None, available_swaps=None, *, late=True, runs=None):
    """(env settings, rule outcome, violations, warnings) without changing anything.
    late=False skips the late-application checks (for judging a recipe outside the training process).
    ``available_swaps`` defaults to every patch declared in ``patches/``. ``runs``: what the built-model
    audit found will run, per rule (``enforce.audit.by_rule``); those rules judge it, not the flags."""
    environ = os.environ if environ is None else environ
    if available_swaps is None:
        from megatron_bitdet.compat.patching import declared_ids

        available_swaps = declared_ids()
    settings, env_problems = resolve_env(recipe, environ)
    facts = dataclasses.replace(collect_facts(effective_env(settings)), runs=dict(runs or {}))
    outcome = evaluate_rules(recipe, facts, available_swaps)
    refusals, warnings = late_application(settings, environ, facts) if late else ([], [])
    violations = [Violation(f"env:{name}", message, ENV_BY_NAME[name].why, fix)
                  for name, message, fix in env_problems]
    violations += outcome.violations
    violations += [Violation("late_application", message, f"{', '.join(names)} would have no effect", fix)
                   for names, message, fix in refusals]
    warnings += [f"opt-out [{o['id']}] at {o['where']}: {o['message']} ({o['why']})" for o in outcome.opt_outs]
    return settings, outcome, violations, warnings


def _apply_torch(recipe) -> dict:
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.utils.deterministic.fill_uninitialized_memory = recipe.determinism.fill_uninitialized_memory
    if recipe.determinism.threads is not None:
        torch.set_num_threads(recipe.determinism.threads)
    return {"use_deterministic_algorithms": True, "cudnn.deterministic": True, "cudnn.benchmark": False,
            "fill_uninitialized_memory": recipe.determinism.fill_uninitialized_memory}


def _install_swaps(swaps) -> list:
    """A rule reported as swapped has its deterministic variant installed, here, for any caller (a
    Megatron-LM script included), after the environment is set (the targets import mamba_ssm etc.)."""
    if not swaps:
        return []
    from megatron_bitdet.compat import cpu_backend, patching

    cpu_backend.install()  # no-op on a GPU; on CPU some target modules import GPU-only packages
    return patching.install(patching.swap_patches(swaps))


def enable(recipe, *, rank: int = 0, world_size: int = 1, strict: bool = True,
           available_swaps=None) -> Enforcement:
    """Apply --deterministic-mode for ``recipe`` in this process (call before CUDA, process groups, TE and
    model build): env, torch flags, and the patches behind every swap the rules resolved.
    strict: raise DeterminismViolation listing every violation; else keep them as warnings.
    ``rank``/``world_size`` only label warnings; each rank enforces for itself."""
    import torch

    if not recipe.determinism.mode:
        return Enforcement(mode=False, threads=torch.get_num_threads(),
                           warnings=["determinism.mode is false: nothing enforced"])
    settings, outcome, violations, warnings = plan(recipe, available_swaps=available_swaps)
    if violations and strict:
        raise DeterminismViolation(violations)
    warnings += [f"[{v.rule_id}] {v.message} (not strict: continuing)" for v in violations]
    for name, setting in settings.items():
        if setting.source in ("recipe", "default"):
            os.environ[name] = setting.value
    flags = _apply_torch(recipe)
    patches = _install_swaps(outcome.swaps)
    if world_size > 1:
        warnings = [f"rank {rank}: {w}" for w in warnings]
    return Enforcement(mode=True, env=settings, rules=outcome, torch=flags,
                       threads=torch.get_num_threads(), warnings=warnings, patches=patches)
