"""`bitdet doctor`: gather the evidence two runs (or a verify-resume directory) offer, running what is
missing, and rank the catalog's known sources against it.

Two run directories: their validation scopes (a scope change is its own diagnosis), the fingerprint
comparison, then the saved ladder result (RUN_A/ladder/result.json) or, unless offline, the ladder
itself with its kernel rung. A run resumed from a checkpoint is not re-run: its divergence after the
restore points at verify-resume. One directory: a verify-resume --out directory (verify_resume.json).

Two Megatron-LM runs go through the same ladder (it re-launches their lines), and each next command is
said in the line's language: a fixcheck of the run's script and launch line with the fix as flags to add
or drop (a recipe key the flags table maps; else ``--bitdet-override``), env, or another ``--spec``;
verify-resume on the line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_bitdet.analysis.compare import ScopeMismatchError, compare_runs
from megatron_bitdet.analysis.diagnose import (
    Diagnosis, diagnose, facts_from_compare, facts_from_ladder, facts_from_resume, facts_from_scope, flatten,
)
from megatron_bitdet.workflows.ladder import LadderConfig, load_ladder_result, run_ladder
from megatron_bitdet.workflows.resume import load_resume_report
from megatron_bitdet.enforce.manifest import load_manifest
from megatron_bitdet.errors import BitdetInputError


@dataclass
class DoctorReport:
    diagnosis: Diagnosis
    sources: list = field(default_factory=list)   # what the evidence came from, in order
    verdict: str = ""                              # the comparison's own verdict, one line

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "sources": self.sources, **self.diagnosis.to_json()}


_FIX = re.compile(r"--fix(-env)? ([A-Za-z_][\w.]*)=(\S+)")  # in a catalog entry's next command
_CHANGE = re.compile(r"\b([a-z_]+(?:\.[a-z_0-9]+)+)=([\w.:-]+)")  # recipe assignments in its fix text


def _manifest(run):
    try:
        return load_manifest(run)
    except BitdetInputError:
        return None


def _resumed(run) -> bool:
    argv = (_manifest(run) or {}).get("argv") or []
    return "--load" in argv or any(str(a).startswith("--load=") for a in argv)


def _recipe(run):
    return (_manifest(run) or {}).get("recipe")


def _set_in(manifest: dict, env: bool, key: str, value: str) -> bool:
    """Was ``key=value`` already in effect in the run this manifest describes?"""
    if env:
        return ((manifest.get("env") or {}).get(key) or {}).get("value") == value
    recipe = flatten(manifest.get("recipe") or {})
    return key in recipe and recipe[key] == yaml.safe_load(value)


def _advice_that_changes_something(d: Diagnosis, manifests: list, run_a, run_b) -> None:
    """A cause whose suggested fix both runs already had (their manifests say so) gets another next
    step: a recipe change from its fix that they did not have, else a fixed model provider (the source
    is in the provider's code, which the recipe does not govern), else localizing the culprit op."""
    for c in d.causes:
        fixes = [(bool(env), key, value) for env, key, value in _FIX.findall(c.next)]
        if not fixes or not all(_set_in(m, *f) for m in manifests for f in fixes):
            continue
        others = [(False, k, v) for k, v in _CHANGE.findall(c.fix.get("change", ""))]
        unset = [f for f in others if not all(_set_in(m, *f) for m in manifests)]
        provider = (manifests[0].get("scope") or {}).get("model_provider")
        if unset:
            c.next = f"bitdet fixcheck --recipe RECIPE --fix {unset[0][1]}={unset[0][2]}"
        elif provider and provider != "default":
            c.next = f"bitdet fixcheck --recipe RECIPE --model-provider {provider} --fix-provider MODULE:FIXED_PROVIDER"
        else:
            c.next = f"bitdet localize {run_a} {run_b} --levels module,op"
        d.notes.append(f"[{c.id}] {', '.join(f'{k}={v}' for _, k, v in fixes)} is already set in both runs "
                       f"(their manifests): that fix would change nothing; next: {c.next}")
    if d.top is not None:
        d.next = d.top.next


def _fix_in_flags(key: str, value: str, line: list) -> str:
    """A recipe fix ``key=value`` as fixcheck's flag options: the flag the flags table renders for it (a
    switch turned off: dropped, when the line has it), else the entry point's ``--bitdet-override`` (with
    ``--recipe RECIPE`` when the line has no recipe)."""
    from megatron_bitdet.megatron_lm.args import TABLE

    row = next((r for r in TABLE if r.key == key and r.flag), None)
    tokens = None if row is None else row.put(yaml.safe_load(value)) if row.put else [row.flag, value]
    if tokens:
        return f'--fix-flags "{" ".join(tokens)}"'
    if row is not None and row.flag in line:
        return f"--fix-drop {row.flag[2:]}"
    recipe = "" if "--recipe" in line else "--recipe RECIPE "
    return f'--fix-flags "{recipe}--bitdet-override {key}={value}"'


def _in_line_language(d: Diagnosis, manifest: dict) -> None:
    """Next commands for a Megatron-LM run: the recipe's fixcheck / verify-resume become the line's."""
    import shlex

    from megatron_bitdet.megatron_lm.launch import rerun_args

    argv = manifest.get("argv") or []
    if not argv:
        return
    head = f"--megatron-lm {shlex.quote(argv[0])}"
    words = rerun_args(list(argv[1:]))
    line = f"-- {shlex.join(words)}"

    def said(command: str) -> str:
        if command.startswith("bitdet verify-resume --recipe RECIPE"):
            return command.replace("--recipe RECIPE", head) + f" {line}"
        if not command.startswith("bitdet fixcheck --recipe RECIPE"):
            return command
        fix = command[len("bitdet fixcheck --recipe RECIPE"):].strip()
        m = _FIX.fullmatch(fix)
        if m and m.group(1):  # --fix-env: the same option
            flags = fix
        elif m:
            flags = _fix_in_flags(m.group(2), m.group(3), words)
        else:  # --fix-provider: under Megatron-LM the model is the --spec
            flags = '--fix-flags "--spec MODULE FIXED_SPEC"' if fix.startswith("--fix-provider") else None
        return command if flags is None else f"bitdet fixcheck {head} {flags} {line}"

    for c in d.causes:
        c.next = said(c.next)
    d.next = said(d.next)


def doctor(run_a, run_b=None, *, offline: bool = False, ladder: LadderConfig = LadderConfig()) -> DoctorReport:
    """Evidence from what exists (running compare, and the ladder unless ``offline``), ranked causes."""
    if run_b is None:
        report = load_resume_report(run_a)
        if report is None:
            raise BitdetInputError(f"{run_a}: no verify_resume.json; give two run directories, or a "
                                   "verify-resume --out directory")
        verdict = "resume holds" if report["holds"] else "resume broken"
        d = diagnose(facts_from_resume(report))
        if report["holds"]:
            d.causes, d.next = [], ""
            d.notes.append("the resume holds: nothing to diagnose")
        return DoctorReport(d, [f"verify-resume: {Path(run_a) / 'verify_resume.json'}"], verdict)
    try:
        cmp = compare_runs(run_a, run_b)
    except ScopeMismatchError as exc:
        d = diagnose(facts_from_scope(exc.mismatches, _recipe(run_a), _recipe(run_b)))
        d.notes.append("the runs were made in different validation scopes: compare refuses them (--force "
                       "compares anyway, knowing the bits may legitimately differ)")
        return DoctorReport(d, ["compare: scopes differ"], "scope mismatch")
    sources = [f"compare: {cmp.verdict} over {cmp.steps_compared} steps x {len(cmp.ranks_compared)} ranks"]
    if cmp.verdict == "match":
        d = Diagnosis(facts={}, notes=[f"fingerprints match over {cmp.steps_compared} steps: nothing to diagnose"])
        return DoctorReport(d, sources, "match")
    if cmp.verdict == "incomplete":
        why = (f"steps missing: {cmp.missing_steps()}" if cmp.lengths_differ
               else f"cut short: {', '.join(cmp.truncated)}")
        d = Diagnosis(facts={}, notes=[f"the {cmp.steps_compared} common steps match, but {why}: not a match, and "
                                       "no divergence to diagnose (a run stopped early?)"])
        return DoctorReport(d, sources, "incomplete")
    resumed = _resumed(run_a) or _resumed(run_b)
    facts = [facts_from_compare(cmp, resumed=resumed)]
    div = cmp.first_divergence
    verdict = f"diverged at step {div.step} on rank(s) {div.ranks}"
    saved = load_ladder_result(run_a, run_b)
    if saved is not None:
        sources.append(f"localize: {Path(run_a) / 'ladder' / 'result.json'}")
    elif resumed:
        sources.append("localize: not run (a resumed run; the ladder re-runs from iteration 0)")
    elif offline:
        sources.append("localize: not run (--offline)")
    else:
        saved = run_ladder(run_a, run_b, ladder).to_json()
        sources.append("localize: ran the ladder" + (" and the kernel rung" if ladder.kernel else ""))
    if saved is not None:
        facts.append(facts_from_ladder(saved))
    unsure = ("bitdet verify-resume --recipe RECIPE --resume-at K" if resumed
              else f"bitdet localize {run_a} {run_b}")
    d = diagnose(*facts, next_if_unsure=unsure)
    manifests = [_manifest(run_a), _manifest(run_b)]
    if None not in manifests:
        _advice_that_changes_something(d, manifests, run_a, run_b)
        if manifests[0].get("megatron_lm"):
            _in_line_language(d, manifests[0])
    if saved is None:
        d.notes.append(f"ranked from the fingerprints only; `{unsure}` gives the evidence that tells causes apart")
    return DoctorReport(d, sources, verdict)
