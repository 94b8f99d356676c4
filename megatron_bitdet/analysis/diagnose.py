"""Rank the catalog's known sources against what compare / verify-resume / localize / the kernel rung
found. Evidence is a flat dict of facts; each catalog symptom field that a fact confirms adds its
weight, one that a fact contradicts subtracts it, an unknown fact counts nothing. Only causes with a
positive score and at least one confirmed field are listed, best first."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_bitdet.enforce.catalog import Catalog, load_catalog

WEIGHTS = {"first_step": 1, "metrics": 3, "lm_loss_equal": 2, "scope_keys": 4, "resume_components": 8,
           "classification": 2, "read_artifact": 3, "ops": 3, "modules": 2, "kernel_mechanism": 5,
           "deterministic_variant": 2}
# a contradicted weak field costs less than it earns when confirmed (module names are only hints)
PENALTY = {"modules": 1, "ops": 1}


@dataclass
class Cause:
    id: str
    title: str
    score: int
    evidence: list
    mechanism: str
    fix: dict
    next: str


@dataclass
class Diagnosis:
    facts: dict
    causes: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    next: str = ""

    @property
    def top(self) -> Cause | None:
        return self.causes[0] if self.causes else None

    def to_json(self) -> dict:
        return {**asdict(self), "top": self.top.id if self.top else None}

    def headline(self) -> str:
        """One line for localize / verify-resume: the doctor's top entry, its fix and the next command."""
        t = self.top
        if t is None:
            return "doctor: no known source matches this evidence" + (f"; next: {self.next}" if self.next else "")
        return (f"doctor: most likely [{t.id}] {t.title} — fix: {t.fix['change']} ({t.fix['kind']}); "
                f"next: {t.next}")


def _scope_key_match(fact_key: str, pattern: str) -> bool:
    return fact_key == pattern or (pattern.endswith(("/", "_", ".")) and fact_key.startswith(pattern))


def _judge(name: str, want, facts: dict):
    """(+1 confirmed, -1 contradicted, 0 unknown, matched detail)."""
    have = facts.get(name)
    if have is None or have == []:
        if name in ("scope_keys", "resume_components") and facts.get(f"{name}_checked"):
            return -1, ""
        return 0, ""
    if name == "first_step":
        return (1, f"first divergent step: {have}") if have == want else (-1, "")
    if name == "lm_loss_equal":
        return (1, f"lm_loss {'bit-identical' if have else 'differs'} at the first divergent step") \
            if have == want else (-1, "")
    if name == "metrics":
        hit = [m for m in have if any(m.startswith(w) for w in want)]
        return (1, f"differing first: {', '.join(hit[:4])}") if hit else (-1, "")
    if name == "scope_keys":
        hit = [k for k in have if any(_scope_key_match(k, w) for w in want)]
        return (len(hit), f"validation scope differs in {', '.join(hit)}") if hit else (-1, "")
    if name == "resume_components":
        hit = [c for c in have if any(c.startswith(w) for w in want)]
        return (1, f"restored state differs: {', '.join(hit)}") if hit else (-1, "")
    if name in ("ops", "modules", "read_artifact"):
        hit = [w for w in want if w in have]
        return (1, f"{name[:-1] if name != 'read_artifact' else 'read artifact'} {have}") if hit else (-1, "")
    # classification, kernel_mechanism, deterministic_variant: categorical
    labels = {"classification": "localize culprit", "kernel_mechanism": "kernel rung",
              "deterministic_variant": "torch deterministic variant"}
    return (1, f"{labels[name]}: {have}") if have in want else (-1, "")


def rank(facts: dict, catalog: Catalog | None = None) -> list[Cause]:
    catalog = catalog or load_catalog()
    causes = []
    for e in catalog.entries:
        score, lines = 0, []
        for name, want in e.symptom.items():
            verdict, detail = _judge(name, want, facts)
            if verdict > 0:
                score += WEIGHTS[name] * verdict
                lines.append(detail)
            elif verdict < 0:
                score -= PENALTY.get(name, WEIGHTS[name])
        if score > 0 and lines:
            causes.append(Cause(e.id, e.title, score, lines, e.mechanism, dict(e.fix), e.next))
    causes.sort(key=lambda c: -c.score)  # stable: catalog order breaks ties
    return causes


# ----------------------------------------------------------------------------- evidence builders


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def recipe_changes(a: dict, b: dict) -> list[str]:
    """Dotted recipe keys whose values differ between two resolved recipes."""
    fa, fb = flatten(a), flatten(b)
    return [k for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def facts_from_scope(mismatches: list[dict], recipe_a: dict | None = None, recipe_b: dict | None = None) -> dict:
    """Scope keys that differ; a differing recipe digest is replaced by the recipe keys behind it."""
    keys = [m["key"] for m in mismatches]
    if "recipe_digest" in keys and isinstance(recipe_a, dict) and isinstance(recipe_b, dict):
        keys = [k for k in keys if k != "recipe_digest"] + [f"recipe/{k}" for k in recipe_changes(recipe_a, recipe_b)]
    return {"scope_keys": keys, "scope_keys_checked": True}


def facts_from_compare(cmp, resumed: bool = False) -> dict:
    """From a CompareResult: the first divergent step relative to the start (or, for a run resumed from
    a checkpoint, to the restore: its first fingerprinted step), and which metrics differ there."""
    facts = {"scope_keys_checked": True, "scope_keys": [m["key"] for m in cmp.scope_mismatches]}
    div = cmp.first_divergence
    if div is None:
        return facts
    first_compared = min((s.step for s in cmp.per_step), default=div.step)
    if div.step == first_compared:
        facts["first_step"] = "after_restore" if resumed else "start"
    else:
        facts["first_step"] = "later"
    facts["first_step_number"] = div.step
    facts["metrics"] = list(div.metrics)
    if "lm_loss" in cmp.metrics_compared:
        facts["lm_loss_equal"] = "lm_loss" not in div.metrics
    facts["ranks"] = div.ranks
    return facts


def facts_from_ladder(ladder: dict) -> dict:
    """From a LadderResult's JSON: the culprit's role, op, module, and the kernel rung's mechanism."""
    facts: dict = {}
    if ladder.get("first_step"):  # the ladder re-runs from iteration 0 only: step 1 is the start
        facts["first_step"] = "start" if ladder["first_step"] == 1 else "later"
        facts["metrics"] = list(ladder.get("first_metrics") or [])
        if facts["metrics"]:
            facts["lm_loss_equal"] = "lm_loss" not in facts["metrics"]
    c = ladder.get("culprit")
    if c:
        facts["classification"] = c.get("classification")
        facts["op"] = c.get("op")
        facts["ops"] = c.get("op")
        facts["modules"] = c.get("module") or ""
        if c.get("classification") == "read_artifact":
            facts["read_artifact"] = c.get("evidence", "")
    k = ladder.get("kernel") or {}
    if k.get("mechanism"):
        facts["kernel_mechanism"] = k["mechanism"]
    if k.get("deterministic_variant") and k["deterministic_variant"] != "n/a":
        facts["deterministic_variant"] = k["deterministic_variant"]
    return facts


def facts_from_resume(report: dict) -> dict:
    """From a verify-resume report's JSON: failing components and where outputs first differ."""
    failing = []
    first = None
    for p in report.get("points", []):
        failing += [c for c in p.get("failing_components", []) if c not in failing]
        if p.get("step") and p.get("first_output_divergence") is not None and first is None:
            first = "after_restore" if p["first_output_divergence"] == p["step"] + 1 else "later"
    facts = {"resume_components": failing, "resume_components_checked": True}
    if first:
        facts["first_step"] = first
    return facts


def diagnose(*fact_sets: dict, catalog: Catalog | None = None, next_if_unsure: str = "") -> Diagnosis:
    facts: dict = {}
    for f in fact_sets:
        facts.update({k: v for k, v in f.items() if v is not None})
    d = Diagnosis(facts=facts, causes=rank(facts, catalog))
    d.next = d.top.next if d.top else next_if_unsure
    return d
