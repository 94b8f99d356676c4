"""The rules table (fail closed): features without a deterministic path, each with why, fix and an optional
deterministic ``swap`` a registered patch may substitute.

A rule's ``detects(recipe, facts)`` returns a message when the rule fires, else None.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from megatron_bitdet.enforce.env import ENV_BY_NAME, NCCL_DETERMINISTIC, nccl_refusal
from megatron_bitdet.enforce.facts import Facts, version_tuple
from megatron_bitdet.recipe import RecipeError


@dataclass(frozen=True)
class Violation:
    rule_id: str
    message: str
    why: str
    fix: str


@dataclass(frozen=True)
class Rule:
    id: str
    detects: Callable[..., Optional[str]]
    why: str
    fix: str
    swap: Optional[str] = None


def _moe(recipe) -> bool:
    return recipe.model.has("E")


def _te_attention(recipe, facts: Facts) -> bool:
    spec = recipe.model.spec
    return recipe.model.has("*") and (spec == "te" or (spec == "auto" and facts.has("transformer-engine")))


def _flag(test, message):
    return message if test else None


def _audited(rule_id: str, r, f, fallback: bool, message: str):
    """What will run decides where the audit looked (``f.runs``): the known nondeterministic
    implementations it found, by position and class; elsewhere the recipe's flag."""
    if rule_id in f.runs:
        found = [x for x in f.runs[rule_id] if x.source]
        return "; ".join(f"{x.position} is {x.runs}" for x in found) or None
    return _flag(fallback, message)


def _te_attention_runs(r, f):
    if f.env.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0":
        return None
    found = _audited("te_attention_nondeterministic", r, f, _te_attention(r, f), "TE attention (the te spec)")
    return found and f"{found} with NVTE_ALLOW_NONDETERMINISTIC_ALGO={f.env.get('NVTE_ALLOW_NONDETERMINISTIC_ALGO')!r}"


RULES = (
    Rule("cross_entropy_loss_fusion",
         lambda r, f: _flag(r.model.cross_entropy_loss_fusion, "model.cross_entropy_loss_fusion is true"),
         "the fused vocab-parallel cross entropy reduces with a nondeterministic order (upstream refuses it)",
         "set model.cross_entropy_loss_fusion: false"),
    Rule("tp_comm_overlap",
         lambda r, f: _flag(r.parallel.tp_comm_overlap, "parallel.tp_comm_overlap is true"),
         "TE userbuffers overlap splits GEMM + reduce-scatter into chunks whose reduction order varies "
         "(upstream refuses it)",
         "set parallel.tp_comm_overlap: false"),
    Rule("nccl_tree",
         lambda r, f: nccl_refusal(f.env["NCCL_ALGO"]) if "NCCL_ALGO" in f.env else None,
         "NCCL picks Tree/NVLS/PAT per message size and topology; their reduction order differs from Ring's "
         "and between allocations",
         f"export NCCL_ALGO=Ring (accepted: a list of {', '.join(NCCL_DETERMINISTIC)}; never a ^ exclusion) "
         "or unset it"),
    Rule("moe_router_fusion",
         lambda r, f: _flag(_moe(r) and r.model.moe.router_fusion, "model.moe.router_fusion is true"),
         "TE's fused_moe_aux_loss accumulates the load-balancing loss with atomicAdd across CTAs: "
         "MoE-only divergence (upstream does not refuse it)",
         "set model.moe.router_fusion: false",
         swap="moe_aux_loss"),
    Rule("moe_permute_fusion",
         lambda r, f: _flag(_moe(r) and r.model.moe.permute_fusion, "model.moe.permute_fusion is true"),
         "megatron-core 0.16.1 only takes its deterministic index_add_ unpermute when the permute is NOT "
         "fused; TE's fused unpermute merges top-k copies with its own reduction",
         "set model.moe.permute_fusion: false"),
    Rule("te_grouped_gemm",
         lambda r, f: _audited("te_grouped_gemm", r, f, _moe(r) and r.model.moe.expert_impl == "te_grouped",
                               "model.moe.expert_impl is te_grouped"),
         "TE / cuDNN-frontend grouped MLP backward adds each N-subtile's partial dprob into dprob[token] "
         "with a float atomic add",
         "set model.moe.expert_impl: grouped (bitdet private-slot grouped GEMM) or sequential",
         swap="grouped_gemm_dprob"),
    Rule("torch_compile_max_autotune",
         lambda r, f: _flag("1" in (f.env.get("TORCHINDUCTOR_MAX_AUTOTUNE"), f.env.get("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM")),
                            "torch.compile max-autotune requested (TORCHINDUCTOR_MAX_AUTOTUNE*=1)"),
         "inductor max-autotune benchmarks candidate kernels at run time and keeps the fastest, which differs "
         "between runs",
         "export TORCHINDUCTOR_MAX_AUTOTUNE=0 and TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=0 (or unset them)"),
    Rule("causal_conv1d_old",
         lambda r, f: _flag(r.model.has("M") and f.has("causal-conv1d")
                            and version_tuple(f.versions["causal-conv1d"]) < (1, 6),
                            f"causal-conv1d {f.versions.get('causal-conv1d')} is installed (< 1.6)"),
         "causal_conv1d before 1.6 accumulates the weight gradient with atomics; 1.6 added the per-block "
         "workspace that CAUSAL_CONV1D_DETERMINISTIC=1 selects",
         "pip install 'causal-conv1d>=1.6'",
         swap="causal_conv1d"),
    Rule("mamba_ssm_nondeterministic",
         lambda r, f: _flag(r.model.has("M") and f.has("mamba-ssm") and f.deterministic_support.get("mamba-ssm") is False,
                            f"mamba-ssm {f.versions.get('mamba-ssm')} has no MAMBA_DETERMINISTIC switch"),
         "Mamba-2 backward kernels (chunk-scan dC/dx/ddA, chunk-state dx/dB/ddA, combined dx) use atomic adds "
         "and an autotuned block size",
         "install a mamba-ssm whose kernels honour MAMBA_DETERMINISTIC",
         swap="ssd_scan"),
    Rule("flash_attention",
         lambda r, f: _flag(r.model.has("*") and r.model.attention_backend == "flash",
                            "model.attention_backend is flash (--attention-backend flash / --use-flash-attn)"),
         "flash-attn's backward accumulates dQ across key blocks with atomic adds unless called with "
         "deterministic=True, which megatron-core 0.16.1 does not pass (Megatron-LM refuses --use-flash-attn)",
         "set model.attention_backend: auto (TE then picks a deterministic backend under "
         "NVTE_ALLOW_NONDETERMINISTIC_ALGO=0) or unfused / local"),
    Rule("te_attention_nondeterministic", _te_attention_runs,
         "TE may then choose flash/fused attention backward kernels that accumulate dQ/dK/dV with atomics; "
         "megatron-core raises at layer build",
         "export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (or unset it: the default is 0)"),
)
RULES_BY_ID = {r.id: r for r in RULES}

# env variables judged by a rule must name a rule that exists
assert all(v.governed_by in RULES_BY_ID for v in ENV_BY_NAME.values() if v.governed_by)


@dataclass
class RuleOutcome:
    """What the rules decided: clear ids, opted-out and swapped ones, and the refusals left."""

    applied: list = field(default_factory=list)
    opt_outs: list = field(default_factory=list)
    swaps: list = field(default_factory=list)
    violations: list = field(default_factory=list)
    runs: dict = field(default_factory=dict)  # rule id -> [{position, runs, source}]: what the audit says runs

    def as_manifest(self) -> dict:
        return {"applied": self.applied, "opt_outs": self.opt_outs, "swaps": self.swaps, "runs": self.runs}


def check_opt_outs(recipe) -> None:
    """Unknown opt-out ids are input errors naming the file and line of the entry."""
    lines = [f"{recipe.where('determinism', 'opt_out', i)}: determinism.opt_out[{i}]: unknown rule id "
             f"{rid!r}; known: {', '.join(RULES_BY_ID)}"
             for i, rid in enumerate(recipe.determinism.opt_out) if rid not in RULES_BY_ID]
    if lines:
        raise RecipeError(lines)


def resolution(rule: Rule, determinism, available_swaps) -> str:
    """How a fired rule is resolved under a recipe's determinism section: "opt_out", "swap" or "refuse"
    (one truth for enable(), megatron_overrides and apply_to_megatron_args)."""
    if rule.id in determinism.opt_out:  # an explicit acceptance beats a swap
        return "opt_out"
    if rule.swap and rule.swap in available_swaps and determinism.swaps:
        return "swap"
    return "refuse"


def evaluate_rules(recipe, facts: Facts, available_swaps=frozenset()) -> RuleOutcome:
    """Evaluate every rule; a fired rule is opted out (recorded, warned), swapped (swap registered
    and determinism.swaps on), or a violation. Nothing is decided one rule at a time."""
    check_opt_outs(recipe)
    out = RuleOutcome(runs={rule: [x.as_dict() for x in found] for rule, found in facts.runs.items()})
    for rule in RULES:
        message = rule.detects(recipe, facts)
        how = message and resolution(rule, recipe.determinism, available_swaps)
        if message is None:
            out.applied.append(rule.id)
        elif how == "opt_out":
            out.opt_outs.append({"id": rule.id, "message": message, "why": rule.why,
                                 "where": recipe.where("determinism", "opt_out")})
        elif how == "swap":
            out.swaps.append({"id": rule.id, "swap": rule.swap, "message": message})
        else:
            fix = rule.fix if not rule.swap else (
                f"{rule.fix}; or let the deterministic variant '{rule.swap}' replace it "
                f"(determinism.swaps: true)")
            out.violations.append(Violation(rule.id, message, rule.why, fix))
    return out
