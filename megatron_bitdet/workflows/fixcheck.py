"""Validate a fix with paired runs: the original pair reproduces the divergence, the fixed pair agrees
bitwise over every step; classify the fix from what it changed and measure what it costs.

The original configuration (recipe + overrides + provider) is run N times, then the fixed one (the
same plus the fix: recipe overrides, another model provider, env variables) N times, into
OUT/original/run_i and OUT/fixed/run_i. Runs of one configuration are compared with run_0 of it:
"diverges" needs one differing pair, "matches" needs every pair bit-identical at every step, rank,
metric and digest, all K steps present. The original's divergence is localized (ladder + kernel
rung) unless turned off; the fix is classified by the catalog's fix_changes; its tax comes from the
interleaved tax machinery (fixed vs original in one launch). Exit 0 only for "original diverges,
fixed matches".

A Megatron-LM launch line (``fixcheck_line``) is checked the same way with the fix in its own language:
flags added to the line (a flag already there takes the fix's value) and flags dropped from it. The
recipe keys the runs' manifests record from their flags are classified as a recipe fix's are; a fix that
changes none of them (another ``--spec`` module of the same family) is code: unclassified. Its tax is
not measured here (``bitdet prove --megatron-lm`` on the fixed line measures a line's tax).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_bitdet.enforce.catalog import load_catalog
from megatron_bitdet.analysis.compare import compare_runs
from megatron_bitdet.analysis.diagnose import flatten
from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.rundir import fresh, logs_dir

RESULT_FILE = "fixcheck.json"


@dataclass
class Fix:
    overrides: list = field(default_factory=list)   # recipe key=value
    provider: str | None = None                     # another model provider (None: the original's)
    env: dict = field(default_factory=dict)         # env variables set for the fixed runs
    add_flags: list = field(default_factory=list)   # Megatron-LM lines: [flag, value...] groups added
    drop_flags: list = field(default_factory=list)  # Megatron-LM lines: flags dropped (with their values)

    def empty(self) -> bool:
        return not (self.overrides or self.provider or self.env or self.add_flags or self.drop_flags)


def flag_groups(text: str, what: str) -> list[list[str]]:
    """``"--a 1 --b --c x y"`` -> [["--a", "1"], ["--b"], ["--c", "x", "y"]] (a flag and the values after it)."""
    import shlex

    groups: list[list[str]] = []
    for word in shlex.split(text):
        if word.startswith("--"):
            groups.append([word])
        elif groups:
            groups[-1].append(word)
        else:
            raise BitdetInputError(f"{what} {text!r}: expected flags (--name [values]), got {word!r} first")
    if not groups:
        raise BitdetInputError(f"{what} {text!r}: no flag in it")
    return groups


def fixed_line(line: list, fix: Fix) -> list[str]:
    """The launch line with the fix: its dropped flags and every flag it adds taken out with all their values
    (``--spec MODULE NAME`` has two), then the added flags appended. A flag to drop that the line does not
    have is refused (exit 2)."""
    names = {a.split("=", 1)[0] for a in line if a.startswith("--")}
    absent = [f for f in fix.drop_flags if f not in names]
    if absent:
        raise BitdetInputError(f"--fix-drop {' '.join(absent)}: not on the launch line")
    dropped = {*fix.drop_flags, *(g[0].split("=", 1)[0] for g in fix.add_flags)}
    kept, dropping = [], False
    for arg in line:
        if arg.startswith("--"):
            dropping = arg.split("=", 1)[0] in dropped
        if not dropping:
            kept.append(arg)
    return [*kept, *(w for g in fix.add_flags for w in g)]


@dataclass
class PairVerdict:
    runs: list
    pairs: list          # [{"a", "b", "verdict", "step", "ranks", "metrics", "steps_compared"}]
    diverged: bool
    matched: bool        # every pair bit-identical over every step
    steps: int


@dataclass
class FixcheckResult:
    out_dir: str
    original: PairVerdict
    fixed: PairVerdict
    changes: list
    kind: str            # corrects | works_around | unclassified | no change
    localize: dict | None = None
    tax: dict | None = None
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.original.diverged and self.fixed.matched

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def to_json(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def headline(self) -> str:
        o, f = self.original, self.fixed
        first = next((p for p in o.pairs if p["verdict"] == "diverged"), None)
        op = (self.localize or {}).get("culprit") or {}
        where = f"step {first['step']}" + (f", {op['op']}" if op.get("op") else "") if first else ""
        left = f"original diverges ({where})" if o.diverged else f"original does NOT diverge over {o.steps} steps"
        right = (f"fixed matches bitwise over {f.steps} steps" if f.matched else
                 "fixed still diverges" + (f" (step {_first(f)['step']})" if _first(f) else " (incomplete runs)"))
        return f"{left}, {right}"


def _first(v: PairVerdict):
    return next((p for p in v.pairs if p["verdict"] == "diverged"), None)


def classify(original, fixed, fix: Fix, catalog=None) -> tuple[list, str]:
    """Each change (recipe key, env variable, provider) with its kind, and the fix's overall kind."""
    catalog = catalog or load_catalog()
    a, b = flatten(original.to_dict()), flatten(fixed.to_dict())
    changes = [{"change": f"{k}={json.dumps(b.get(k))}", "from": a.get(k), "key": k, "value": b.get(k)}
               for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    changes += [{"change": f"env {k}={v}", "env": k, "value": v} for k, v in sorted(fix.env.items())]
    for c in changes:
        row = next((r for r in catalog.fix_changes if _fits(r, c)), None)
        c["kind"], c["what"] = (row.kind, row.what) if row else ("unclassified", "not in the catalog's fix_changes")
    if fix.provider:
        changes.append({"change": f"model provider {fix.provider}", "kind": "unclassified",
                        "what": "a different model builder: what it changes is code, judge it yourself"})
    if (fix.add_flags or fix.drop_flags) and not changes:
        changes.append({"change": " ".join([*(f"drop {f}" for f in fix.drop_flags),
                                            *(f"add {' '.join(g)}" for g in fix.add_flags)]), "kind": "unclassified",
                        "what": "launch-line flags that change no recipe key the runs record (e.g. another --spec "
                                "module): what they change is code, judge it yourself"})
    kinds = {c["kind"] for c in changes}
    if not changes:
        return changes, "no change"
    if "works_around" in kinds:
        return changes, "works_around"
    return changes, "corrects" if kinds == {"corrects"} else "unclassified"


def _fits(row, change: dict) -> bool:
    if row.env:
        return change.get("env") == row.env
    key = change.get("key")
    if key is None or not (key == row.key or (row.key.endswith(".") and key.startswith(row.key))):
        return False
    return not row.has_value or change["value"] == row.value


@contextlib.contextmanager
def _env(values: dict):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch_all(recipe, provider, nproc: int, dirs: list[Path], label: str, line=None) -> None:
    """N runs of one configuration, two at a time side by side (consoles to stderr); ``line``: (script,
    Megatron-LM launch line) instead of a recipe."""
    from megatron_bitdet.train.run import RunOptions, launch_training

    codes: dict = {}

    def one(d: Path):
        try:
            if line is not None:
                from megatron_bitdet.megatron_lm.launch import launch_line

                codes[d] = launch_line(line[0], line[1], nproc=nproc, run_dir=fresh(d))
            else:
                codes[d] = launch_training(recipe, RunOptions(nproc=nproc, run_dir=d, model_provider=provider,
                                                              argv=("bitdet", "fixcheck", f"({label})"), fresh=True))
        except BaseException as exc:  # reported below, in this thread
            codes[d] = exc

    steps = recipe.training.iterations if line is None else "its"
    print(f"[fixcheck] {label}: {len(dirs)} runs of {steps} steps", file=sys.stderr, flush=True)
    with contextlib.redirect_stdout(sys.stderr):
        for i in range(0, len(dirs), 2):
            threads = [threading.Thread(target=one, args=(d,)) for d in dirs[i:i + 2]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    for d in dirs:
        if isinstance(codes[d], BaseException):
            raise codes[d]
        if codes[d] != 0:
            raise BitdetError(f"fixcheck {label} run {d} failed (exit {codes[d]}); see {logs_dir(d)}")


def judge_pairs(dirs: list[Path], steps: int) -> PairVerdict:
    """Every run against run_0: which pairs diverge (first step, ranks, metrics), and whether all match."""
    pairs, matched, diverged = [], True, False
    for d in dirs[1:]:
        cmp = compare_runs(dirs[0], d)
        complete = cmp.steps_compared == steps and not cmp.lengths_differ
        first = cmp.first_divergence
        pairs.append({"a": str(dirs[0]), "b": str(d), "verdict": cmp.verdict, "steps_compared": cmp.steps_compared,
                      "step": first.step if first else None, "ranks": first.ranks if first else [],
                      "metrics": first.metrics if first else [], "complete": complete})
        diverged |= cmp.verdict == "diverged"
        matched &= cmp.verdict == "match" and complete
    return PairVerdict([str(d) for d in dirs], pairs, diverged, matched and bool(pairs), steps)


def _reusable(d: Path, recipe, provider) -> bool:
    from megatron_bitdet.enforce.manifest import load_manifest

    try:
        m = load_manifest(d)
    except BitdetInputError:
        return False
    return m.get("recipe_digest") == recipe.digest() and m.get("model_provider") == provider


def fixcheck(recipe, fixed, fix: Fix, *, nproc: int, out_dir, provider=None, runs: int = 2, localize=True,
             levels=("op",), tax=True, tax_rounds: int = 10, tax_warmup: int = 2, reuse_original=False,
             repeats: int = 20) -> FixcheckResult:
    """The paired-runs validation of ``fix`` (``fixed`` = ``recipe`` with the fix's overrides applied)."""
    from megatron_bitdet.workflows.ladder import LadderConfig, load_ladder_result, run_ladder
    from megatron_bitdet.workflows.tax import measure_tax

    if runs < 2:
        raise BitdetInputError(f"fixcheck --runs {runs}: need at least 2 runs per configuration (a pair)")
    if fix.empty():
        raise BitdetInputError("fixcheck needs a fix: --fix KEY=VALUE, --fix-provider MODULE:FUNC or --fix-env NAME=VALUE")
    out_dir = Path(out_dir)
    steps = recipe.training.iterations
    if fixed.training.iterations != steps:
        raise BitdetInputError("the fix must not change training.iterations (both pairs are compared over K steps)")
    orig_dirs = [out_dir / "original" / f"run_{i}" for i in range(runs)]
    fixed_dirs = [out_dir / "fixed" / f"run_{i}" for i in range(runs)]
    notes = []
    todo = orig_dirs
    if reuse_original:  # runs (and their saved ladder) of the same recipe and provider are kept
        todo = [d for d in orig_dirs if not _reusable(d, recipe, provider)]
        if len(todo) < runs:
            notes.append(f"reused {runs - len(todo)} original run(s) of the same recipe and provider")
    if todo:
        _launch_all(recipe, provider, nproc, todo, "original")
    original_v = judge_pairs(orig_dirs, steps)  # a reused run's missing or broken file: refused before more launches
    fixed_provider = fix.provider or provider
    with _env(fix.env):
        _launch_all(fixed, fixed_provider, nproc, fixed_dirs, "fixed")
    fixed_v = judge_pairs(fixed_dirs, steps)
    changes, kind = classify(recipe, fixed, fix)
    result = FixcheckResult(str(out_dir), original_v, fixed_v, changes, kind, notes=notes)
    first = _first(original_v)
    if localize and first:
        saved = load_ladder_result(first["a"], first["b"]) if reuse_original and not todo else None
        if saved is not None:
            notes.append(f"reused the original pair's saved ladder result ({first['a']}/ladder/result.json)")
        result.localize = saved or run_ladder(Path(first["a"]), Path(first["b"]),
                                              LadderConfig(levels=tuple(levels), repeats=repeats)).to_json()
    if not original_v.diverged:
        notes.append("the original pair did not diverge: the fix cannot be shown to fix anything "
                     "(more runs, more steps, or a configuration that reproduces it)")
    if tax and result.ok:
        if fix.env:
            notes.append("tax not measured: an env change applies process-wide, so one interleaved launch "
                         "cannot run both sides")
        else:
            t = measure_tax(fixed, nproc=nproc, rounds=tax_rounds, warmup=tax_warmup, profile_steps=1,
                            out_dir=out_dir / "tax", model_provider=fixed_provider, against=recipe,
                            against_provider=provider)
            result.tax = {"tax_percent": t.tax_percent, "paired_tax_percent": t.paired_tax_percent,
                          "fixed_ms": t.deterministic.median_ms, "original_ms": t.baseline.median_ms,
                          "rounds": t.config.rounds, "nproc": t.nproc, "threads": t.threads,
                          "grew_most": t.dominant}
    elif tax:
        notes.append("tax not measured: the fix was not validated")
    (out_dir / RESULT_FILE).write_text(json.dumps(result.to_json(), indent=1))
    return result


def _localize(result: FixcheckResult, levels, repeats: int) -> None:
    from megatron_bitdet.workflows.ladder import LadderConfig, run_ladder

    first = _first(result.original)
    if first:
        result.localize = run_ladder(Path(first["a"]), Path(first["b"]),
                                     LadderConfig(levels=tuple(levels), repeats=repeats)).to_json()


def fixcheck_line(script: str, line: list, fix: Fix, *, nproc: int, out_dir, runs: int = 2, localize=True,
                  levels=("op",), repeats: int = 20) -> FixcheckResult:
    """The paired-runs validation of ``fix`` (flags to add / drop, env) on a Megatron-LM launch line."""
    from megatron_bitdet.megatron_lm.launch import pasted
    from megatron_bitdet.recipe import Recipe
    from megatron_bitdet.workflows.megatron_resume import train_iters

    if runs < 2:
        raise BitdetInputError(f"fixcheck --runs {runs}: need at least 2 runs per configuration (a pair)")
    if fix.overrides or fix.provider:
        raise BitdetInputError("with --megatron-lm the fix is the launch line's: --fix-flags FLAGS, --fix-drop FLAG "
                               "(or --fix-env NAME=VALUE); not --fix KEY=VALUE / --fix-provider")
    if not (fix.add_flags or fix.drop_flags or fix.env):
        raise BitdetInputError("fixcheck needs a fix: --fix-flags FLAGS, --fix-drop FLAG or --fix-env NAME=VALUE")
    line = pasted(line, "fixcheck")
    fixed = fixed_line(line, fix)
    steps = train_iters(line)
    if train_iters(fixed) != steps:
        raise BitdetInputError("the fix must not change --train-iters (both pairs are compared over its steps)")
    out_dir = Path(out_dir)
    orig_dirs = [out_dir / "original" / f"run_{i}" for i in range(runs)]
    fixed_dirs = [out_dir / "fixed" / f"run_{i}" for i in range(runs)]
    _launch_all(None, None, nproc, orig_dirs, "original", line=(script, line))
    with _env(fix.env):
        _launch_all(None, None, nproc, fixed_dirs, "fixed", line=(script, fixed))
    original_v, fixed_v = judge_pairs(orig_dirs, steps), judge_pairs(fixed_dirs, steps)
    recorded = [Recipe.from_dict(_recorded(d), source=str(d / "manifest.json")) for d in (orig_dirs[0], fixed_dirs[0])]
    changes, kind = classify(*recorded, fix)
    result = FixcheckResult(str(out_dir), original_v, fixed_v, changes, kind,
                            notes=["tax not measured for a Megatron-LM line: `bitdet prove --megatron-lm` on the "
                                   "fixed line measures it"])
    if localize:
        _localize(result, levels, repeats)
    if not original_v.diverged:
        result.notes.append("the original pair did not diverge: the fix cannot be shown to fix anything "
                            "(more runs, more steps, or a line that reproduces it)")
    (out_dir / RESULT_FILE).write_text(json.dumps(result.to_json(), indent=1))
    return result


def _recorded(run_dir: Path) -> dict:
    """The recipe a Megatron-LM run's manifest recorded from its flags."""
    from megatron_bitdet.enforce.manifest import load_manifest

    return load_manifest(run_dir)["recipe"]
