"""Replay one step of a finished run bitwise from a checkpoint, and take a loss spike apart.

``replay(RUN_DIR, K)`` resumes from the newest complete checkpoint that leaves ``context`` steps before
K (iteration 0 when there is none), re-runs to K under the run's manifest (recipe, model provider,
world size) and checks every replayed step's fingerprint against the original's, every rank, bit for
bit. At the first step that differs on any rank every rank stops, and the cause is named from the
manifests: a scope difference (threads, env, software...), or, with equal scopes, a checkpoint that does
not hold the original's state or a change outside the recorded scope. With the replay verified, step K
is ranked module by module against the replayed steps before it (``analysis.spike``).

A counterfactual replays the same steps with one change at K (skip a micro-batch, zero one expert's
router probability, give one module the params it had a step earlier); it must reproduce the original
bitwise up to K-1, and its loss at K is set against the previous steps' range.

A Megatron-LM run (``bitdet megatron-lm``) is replayed from its own checkpoints (the line's ``--save``
directory, torch_dist format: an ``iter_N`` with ``metadata.json``): its launch line re-run with
``--load ROOT --ckpt-step N --exit-interval K`` (workflows.relaunch) by a rank worker that adds the
statistics and the change as step hooks of the Megatron-LM hooks. It runs to K (no stop at a first
difference) and the steps are compared afterwards; skip-microbatch is refused there (the script draws its
micro-batches inside its own forward_step).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_bitdet.analysis.compare import compare_runs
from megatron_bitdet.analysis.fingerprints_io import load_run, require_every_rank
from megatron_bitdet.analysis.spike import load_stats, merge, rank_modules, router_load
from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.fingerprint.floatbits import decode_float
from megatron_bitdet.rundir import checkpoints_dir, iter_dir, replay_dir
from megatron_bitdet.train.checkpoint import META, verify_checkpoint
from megatron_bitdet.workflows.relaunch import RelaunchSpec, StaleRecipe, flag_value, relaunch, relaunch_spec

RESULT = "replay.json"
WORKER = "megatron_bitdet.workflows.replay_worker:replay_worker"
MEGATRON_WORKER = "megatron_bitdet.workflows.replay_worker:megatron_replay_worker"
LOSS = "lm_loss"
_CHANGE = re.compile(r"(skip-microbatch):(\d+)(?:@(\d+))?|(zero-expert):(\d+)\.(\d+)|(prev-params):([\w.]+)")


def parse_change(text: str) -> dict:
    """'skip-microbatch:M[@RANK]' | 'zero-expert:LAYER.EXPERT' | 'prev-params:MODULE' -> the change dict."""
    m = _CHANGE.fullmatch(text.strip())
    if not m:
        raise BitdetInputError(f"--counterfactual {text!r}: expected skip-microbatch:M[@RANK], "
                               "zero-expert:LAYER.EXPERT or prev-params:MODULE")
    if m.group(1):
        return {"kind": "skip-microbatch", "index": int(m.group(2)),
                "rank": None if m.group(3) is None else int(m.group(3))}
    if m.group(4):
        return {"kind": "zero-expert", "layer": int(m.group(5)), "expert": int(m.group(6))}
    return {"kind": "prev-params", "module": m.group(8)}


def describe_change(change: dict) -> str:
    if change["kind"] == "skip-microbatch":
        where = "every rank" if change["rank"] is None else f"rank {change['rank']}"
        return f"skip micro-batch {change['index']} on {where}"
    if change["kind"] == "zero-expert":
        return f"zero expert {change['expert']}'s router probability in layer {change['layer']}"
    return f"previous step's params for {change['module']}"


@dataclass
class ReplayResult:
    run_dir: str
    step: int
    out: str
    checkpoint: int                  # iteration resumed from (0: from the start)
    replayed: list[int]              # steps the replay was asked to run
    verified: list[int] = field(default_factory=list)   # bitwise equal on every rank
    verdict: str = "reproduced"      # reproduced | diverged
    first_difference: dict | None = None
    cause: str = ""
    scope_differences: list[dict] = field(default_factory=list)
    change: dict | None = None
    loss: dict = field(default_factory=dict)            # step -> lm loss (replay)
    original_loss: float | None = None
    previous_range: tuple | None = None
    within_range: bool | None = None
    ranking: list[dict] = field(default_factory=list)
    per_rank: dict = field(default_factory=dict)
    routers: dict = field(default_factory=dict)
    dump: str | None = None
    note: str = ""

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "reproduced" else 1

    def to_json(self) -> dict:
        return asdict(self)


def _spec(run_dir: Path, overrides) -> RelaunchSpec:
    """The run's re-launch spec, for a bitdet train run whose recipe validates under this version."""
    try:
        spec = relaunch_spec(run_dir, overrides)
    except StaleRecipe as exc:
        from megatron_bitdet import __version__

        raise BitdetInputError(f"{exc.where}: the run's recipe (bitdet {exc.version}) does not validate under "
                               f"bitdet {__version__}, so it cannot be replayed here:\n{exc.error}") from None
    return spec


MEGATRON_META = "metadata.json"  # written once a Megatron-LM torch_dist checkpoint is complete


def _megatron_checkpoints(run_dir: Path, spec: RelaunchSpec) -> Path:
    """A Megatron-LM run's checkpoint root: its line's ``--save`` (relative paths from here, as launched)."""
    save = flag_value(list(spec.megatron_args), "--save")
    if save is None:
        raise BitdetInputError(f"{run_dir}: a Megatron-LM run launched without --save: no checkpoint to replay "
                               "from; relaunch with --save DIR --save-interval N, or pass --checkpoints DIR")
    return Path(save)


def choose_checkpoint(root: Path, at_most: int, marker: str = META) -> tuple[int, Path | None]:
    """The newest complete checkpoint (``marker`` present: bitdet's ``bitdet_meta.json``, or a Megatron-LM
    checkpoint's ``metadata.json``) at iteration <= ``at_most``."""
    found = []
    if root.is_dir():
        for d in root.iterdir():
            m = re.fullmatch(r"iter_(\d+)", d.name)
            if m and int(m.group(1)) <= at_most and (d / marker).is_file():
                found.append(int(m.group(1)))
    if not found:
        return 0, None
    return max(found), iter_dir(root, max(found))


def _check_change(change: dict, recipe, nproc: int, step: int, first: int, megatron_lm: bool = False) -> None:
    model = recipe.model
    if megatron_lm and change["kind"] == "skip-microbatch":
        raise BitdetInputError("skip-microbatch on a Megatron-LM run: the script draws its micro-batches inside its "
                               "own forward_step, which the replay does not reach into; replay the change with "
                               "zero-expert:LAYER.EXPERT or prev-params:MODULE instead")
    if change["kind"] == "zero-expert":
        pattern = model.hybrid_pattern
        if not 0 <= change["layer"] < len(pattern) or pattern[change["layer"]] != "E":
            moe = [i for i, c in enumerate(pattern) if c == "E"]
            raise BitdetInputError(f"zero-expert: layer {change['layer']} is not a MoE layer "
                                   f"(pattern {pattern!r}: MoE layers {moe})")
        if not 0 <= change["expert"] < model.moe.num_experts:
            raise BitdetInputError(f"zero-expert: expert {change['expert']} out of range "
                                   f"(model.moe.num_experts={model.moe.num_experts})")
    if change["kind"] == "skip-microbatch":
        t, p = recipe.training, recipe.parallel
        per_rank = t.global_batch_size // (t.micro_batch_size * (nproc // (p.tensor * p.pipeline * p.context)))
        if change["index"] >= per_rank:
            raise BitdetInputError(f"skip-microbatch: index {change['index']}, but a rank runs {per_rank} "
                                   "micro-batches per step (0-based)")
        if change["rank"] is not None and change["rank"] >= nproc:
            raise BitdetInputError(f"skip-microbatch: no rank {change['rank']} (world size {nproc})")
    if step - 1 < first:  # a counterfactual is trusted once the replay has reproduced the steps before it
        how = "use --context >= 1" if step > 1 else "step 1 has no step before it"
        raise BitdetInputError(f"{change['kind']} at step {step}: the replay starts at step {first}, so no step "
                               f"before the change would be reproduced and verified against the original ({how})")


def _recipe(run_dir: Path, spec: RelaunchSpec, manifest: dict):
    """The recipe a change is checked against: a Megatron-LM run's is the one its manifest recorded from its flags."""
    if not spec.megatron_lm:
        return spec.recipe
    from megatron_bitdet.recipe import Recipe

    return Recipe.from_dict(manifest["recipe"], source=str(run_dir / "manifest.json"))


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 28 else text[:20] + "…'"


def _cause(cmp, step: int, first: int, checkpoint: int, overrides=()) -> str:
    if cmp.scope_mismatches:
        keys = sorted(cmp.scope_mismatches, key=lambda m: (m["key"] == "recipe_digest", m["key"]))
        rows = "; ".join(f"{m['key']}: original {_short(m['a'])}, replay {_short(m['b'])}" for m in keys)
        asked = f" (the replay was asked for {', '.join(overrides)})" if overrides else ""
        return f"scope difference: {rows}{asked}"
    if step == first:
        source = f"checkpoint iteration {checkpoint}" if checkpoint else "initialization from the manifest"
        return (f"the scopes are equal, yet the first replayed step differs: the {source} does not give the "
                "state the original had (its file digests verified, so it was saved that way), or the "
                "environment changed outside the recorded scope")
    return (f"the scopes are equal and {step - first} step(s) reproduced first: a change outside the recorded "
            "scope, a hardware fault, or nondeterminism (`bitdet localize` the original and the replay)")


def _loss(run, step: int) -> float | None:
    for rank in sorted(run.ranks, reverse=True):  # the last pipeline stage holds the loss
        for rec in run.ranks[rank]:
            if rec.step == step and LOSS in rec.metrics:
                return decode_float(rec.metrics[LOSS])
    return None


def replay(run_dir, step: int, *, out=None, context: int = 2, overrides=(), checkpoints=None,
           change: dict | None = None, dump: bool = False, nproc: int | None = None) -> ReplayResult:
    """Replay ``step`` of ``run_dir`` (see the module docstring); the result is also written to OUT/replay.json.
    ``dump``: replay once more (verified again) saving the top module's inputs, outputs and output
    gradients at ``step`` on the rank where it departs most, to OUT/dump/<module>.rank_R.pt. ``nproc``: replay
    on that many ranks instead of the run's (``_other_dp``)."""
    result = _replay(Path(run_dir), step, out=out, context=context, overrides=overrides, checkpoints=checkpoints,
                     change=change, nproc=nproc)
    if dump and result.ranking:
        top = result.ranking[0]
        path = Path(result.out) / "dump" / f"{top['module']}.rank_{top['rank']}.pt"
        again = _replay(Path(run_dir), step, out=Path(result.out) / "dump", context=context, overrides=overrides,
                        checkpoints=checkpoints, change=None, nproc=nproc,
                        dump={"module": top["module"], "rank": top["rank"], "path": str(path)})
        if again.verdict != "reproduced" or not path.is_file():
            raise BitdetError(f"the dump replay into {again.out} did not reproduce the original: {again.cause}")
        result.dump = str(path)
    (Path(result.out) / RESULT).write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return result


def _other_dp(spec: RelaunchSpec, nproc: int, recipe) -> RelaunchSpec:
    """The spec of a replay on ``nproc`` ranks of a run made on ``spec.nproc`` (``recipe``: the run's,
    ``_recipe``): a run of ``dp_invariant`` reductions whose layout differs in the data-parallel size alone
    (else exit 2; a Megatron-LM line's own preflight refuses what the mode is not installed for there). Its
    ranks' digests are partials of the logical ones, so no rank stops at a first difference: the replayed
    steps are compared afterwards, as one logical rank (``analysis.compare``)."""
    from megatron_bitdet.workflows.resume import check_other_dp

    if nproc < 1:
        raise BitdetInputError(f"--nproc {nproc}: must be a positive number of ranks")
    check_other_dp(recipe, spec.nproc, nproc, "--nproc")
    return dataclasses.replace(spec, nproc=nproc)


def _replay(run_dir: Path, step: int, *, out, context, overrides, checkpoints, change, dump=None,
            nproc=None) -> ReplayResult:
    original = load_run(run_dir, "bitdet")
    if original.manifest is None:
        raise BitdetInputError(f"{run_dir}: no manifest.json (was the run made by bitdet train?)")
    require_every_rank(original)  # every rank replays against its own lines
    have = set.intersection(*(set(original.steps(r)) for r in original.ranks))
    if step not in have:
        raise BitdetInputError(f"{run_dir}: step {step} is not in the original run on every rank "
                               f"(steps {min(have)}-{max(have)})" if have else f"{run_dir}: no steps")
    if context < 0:
        raise BitdetInputError(f"--context {context}: must be >= 0")
    spec = _spec(run_dir, overrides)
    other_dp = nproc not in (None, spec.nproc)
    if other_dp:
        spec = _other_dp(spec, nproc, _recipe(run_dir, spec, original.manifest))
    root = Path(checkpoints) if checkpoints else (
        _megatron_checkpoints(run_dir, spec) if spec.megatron_lm else checkpoints_dir(run_dir))
    checkpoint, ckpt_path = choose_checkpoint(root, max(0, step - 1 - context),
                                              MEGATRON_META if spec.megatron_lm else META)
    if ckpt_path is not None and not spec.megatron_lm:  # Megatron-LM checks its own on load
        verify_checkpoint(ckpt_path)  # a corrupt file is bad input (exit 2), refused before any rank starts
    first = checkpoint + 1
    missing = [s for s in range(first, step + 1) if s not in have]
    if missing:
        raise BitdetInputError(f"{run_dir}: the original has no fingerprints for step(s) {missing[:5]} to verify "
                               f"against (replaying {first}-{step} from iteration {checkpoint})")
    if change is not None:
        _check_change(change, _recipe(run_dir, spec, original.manifest), spec.nproc, step, first, spec.megatron_lm)
    name = f"step_{step}" + (f"_{describe_change(change).replace(' ', '_')}" if change else "")
    out = Path(out) if out else replay_dir(run_dir, re.sub(r"[^\w.-]", "", name))
    if out.resolve() == run_dir.resolve():
        raise BitdetInputError("--out must differ from the run directory")
    ours = (out / RESULT).is_file() or out.resolve().is_relative_to(replay_dir(run_dir, "").resolve())
    if out.is_dir() and any(out.iterdir()) and not ours:
        raise BitdetInputError(f"--out {out}: exists and is not a replay directory (no {RESULT}); "
                               "a replay empties its directory first")
    result = ReplayResult(str(run_dir), step, str(out), checkpoint, list(range(first, step + 1)), change=change)
    verify_until = step - 1 if change else step
    stats_steps = None if dump else [first, step]
    from megatron_bitdet.train.run import RunOptions, launch_training

    argv = ("bitdet", "replay", str(run_dir), "--step", str(step))
    print(f"[replay] {run_dir}: steps {first}-{step} from "
          f"{'checkpoint iteration ' + str(checkpoint) if ckpt_path else 'the start'}"
          + (f", change at {step}: {describe_change(change)}" if change else ""), file=sys.stderr, flush=True)
    plan = {"original": str(run_dir), "verify_until": verify_until, "stats_steps": stats_steps,
            "change": change, "step": step, "dump": dump, "other_dp": other_dp}
    with contextlib.redirect_stdout(sys.stderr):  # the ranks' consoles; stdout is the report
        if spec.megatron_lm:
            rc = relaunch(spec, out, stop_at=step, load=(root, checkpoint) if ckpt_path else None,
                          worker=MEGATRON_WORKER, worker_args={"replay": {**plan, "run_dir": str(out)}})
        else:
            options = RunOptions(nproc=spec.nproc, run_dir=str(out), load=str(ckpt_path) if ckpt_path else None,
                                 stop_at=step, model_provider=spec.model_provider, argv=argv, save_interval=0,
                                 fresh=True)
            rc = launch_training(spec.recipe, options, worker=WORKER, worker_args={"replay": plan})
    if rc != 0:
        raise BitdetError(f"the replay into {out} failed (exit {rc}); see {out}/logs/")
    replay_run = load_run(out, "bitdet")
    done = set.intersection(*(set(replay_run.steps(r)) for r in replay_run.ranks)) & set(result.replayed)
    if not done:
        raise BitdetError(f"the replay into {out} ran no step; see {out}/logs/")
    cmp = compare_runs(run_dir, out, force=True, steps=sorted(done))
    result.scope_differences = cmp.scope_mismatches
    result.loss = {s: _loss(replay_run, s) for s in result.replayed if _loss(replay_run, s) is not None}
    diverged = [s for s in cmp.diverged_steps if s <= verify_until]
    result.verified = [s for s in result.replayed if s in done and s <= verify_until and (not diverged or s < diverged[0])]
    if diverged:
        div = cmp.first_divergence
        result.verdict = "diverged"
        result.first_difference = {"step": div.step, "ranks": div.ranks, "metrics": div.metrics}
        result.cause = _cause(cmp, div.step, first, checkpoint, overrides)
        return result
    if len(result.verified) != verify_until - first + 1:
        raise BitdetError(f"the replay into {out} stopped early: steps {sorted(done)} of {first}-{step}")
    previous = [s for s in result.replayed if s < step]
    losses = [result.loss[s] for s in previous if s in result.loss]
    result.original_loss = _loss(original, step)
    if losses:
        result.previous_range = (min(losses), max(losses))
        if change is not None and step in result.loss:
            result.within_range = result.loss[step] <= result.previous_range[1]
    if not previous or dump:
        result.note = "" if dump else "no replayed step before K to compare with: use --context >= 1"
        return result
    stats = load_stats(out, spec.nproc)
    per_rank = {r: rank_modules(stats[r], step, previous, r) for r in stats}
    result.per_rank = {r: [d.to_json() for d in rows] for r, rows in per_rank.items()}
    result.ranking = [d.to_json() for d in merge(per_rank)]
    result.routers = router_load(stats, [*previous, step])
    return result
