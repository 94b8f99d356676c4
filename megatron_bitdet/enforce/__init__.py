"""--deterministic-mode: canonical env, torch deterministic algorithms, rules (fail closed), manifest."""
from megatron_bitdet.enforce.apply import Enforcement, enable, plan
from megatron_bitdet.enforce.env import ENV_TABLE, EnvVar, resolve_env
from megatron_bitdet.enforce.facts import Facts, collect_facts
from megatron_bitdet.enforce.manifest import build_manifest, load_manifest, scope_diff, write_manifest
from megatron_bitdet.enforce.megatron import add_args, apply_to_megatron_args, megatron_overrides
from megatron_bitdet.enforce.rules import RULES, RULES_BY_ID, Rule, RuleOutcome, Violation, evaluate_rules

__all__ = [
    "ENV_TABLE", "Enforcement", "EnvVar", "Facts", "RULES", "RULES_BY_ID", "Rule", "RuleOutcome", "Violation",
    "add_args", "apply_to_megatron_args", "build_manifest", "collect_facts", "enable", "evaluate_rules",
    "load_manifest", "megatron_overrides", "plan", "resolve_env", "scope_diff", "write_manifest",
]
