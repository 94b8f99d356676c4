"""``bitdet verify-resume`` on Megatron-LM's own checkpoints: a chain of fresh launches of the user's
script (``--save`` / ``--load --ckpt-step`` / ``--exit-interval``), each restored state compared bitwise
with the uninterrupted run's live state, every later step's fingerprints with its.

A skipped restore is Megatron-LM's own flag, passed to every resumed segment (``--no-load-rng``,
``--no-load-optim``, with ``--accept-skipped-restore``: a plain launch refuses it): what a user would get
wrong, caught by name and first divergent step. The line's own such flags are dropped with a note
(``launch.pasted``).

Across data-parallel sizes (``resume_nproc``, as ``workflows.resume`` for ``bitdet train``): the reference and
segment 0 run at ``nproc``, every resumed segment at ``resume_nproc``, so the first ``--load`` reshards the
checkpoint through ``dist_checkpointing``; only a line whose ``--recipe`` runs ``dp_invariant`` (which under
Megatron-LM's loop means plain DP: one model-parallel rank, ``megatron_lm.virtual_ranks``) gets a verdict.
Every resumed rank is compared with reference rank 0, and the ranks' logical partials are compared added.
"""
from __future__ import annotations

import os
from pathlib import Path

from megatron_bitdet.workflows.resume import ResumeReport, check_other_dp, check_resume_at, run_chain
from megatron_bitdet.rundir import fresh
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.megatron_lm.line_rules import ACCEPT_FLAG

SKIPPABLE = {"rng": "--no-load-rng", "optimizer": "--no-load-optim"}


def _value(megatron_args: list, flag: str) -> int | None:
    """``flag``'s integer value on the line (``--flag N`` or ``--flag=N``); None when absent."""
    for i, arg in enumerate(megatron_args):
        name, eq, inline = arg.partition("=")
        if name == flag:
            text = inline if eq else (megatron_args[i + 1] if i + 1 < len(megatron_args) else "")
            try:
                return int(text)
            except ValueError:
                raise BitdetInputError(f"{flag} {text!r}: expected an integer") from None
    return None


def train_iters(megatron_args: list) -> int:
    """The run's length in iterations: ``--train-iters N``, or a samples-based schedule's ``--train-samples S``
    over ``--global-batch-size B`` (Megatron-LM's own S // B; ``--lr-*-samples`` need nothing more: segments
    stop and save at iterations, and each resumes the consumed-samples count)."""
    iters = _value(megatron_args, "--train-iters")
    if iters is not None:
        return iters
    samples = _value(megatron_args, "--train-samples")
    if samples is None:
        raise BitdetInputError("the launch line needs --train-iters N or --train-samples S (the chain runs to its end)")
    if "--rampup-batch-size" in megatron_args:
        raise BitdetInputError("--train-samples with --rampup-batch-size: the chain needs the run's length in "
                               "iterations; use --train-iters N (or drop the batch-size ramp-up)")
    batch = _value(megatron_args, "--global-batch-size")
    if not batch:
        raise BitdetInputError("--train-samples needs --global-batch-size B on the line (iterations = S // B)")
    return samples // batch


def skipped_restore_flags(skip_restore) -> list[str]:
    """Megatron-LM's own flags for the restores to skip (``rng``, ``optimizer``); refuses others."""
    unknown = [s for s in skip_restore if s not in SKIPPABLE]
    if unknown:
        raise BitdetInputError(f"unknown restore to skip {unknown}; known: {', '.join(SKIPPABLE)}")
    return [SKIPPABLE[s] for s in skip_restore]


def _check_reference(reference: Path, script: str, megatron_args: list, steps: list[int], nproc: int) -> None:
    """A reused reference must be this launch line's uninterrupted run (its output flags aside), on as
    many ranks, with a snapshot for every resume point: else every segment would read as broken."""
    from megatron_bitdet.megatron_lm.launch import rerun_args
    from megatron_bitdet.rundir import manifest_path
    from megatron_bitdet.train.snapshot import check_snapshots
    from megatron_bitdet.workflows.relaunch import relaunch_spec

    spec = relaunch_spec(reference)
    where = manifest_path(reference)
    if not spec.megatron_lm:
        raise BitdetInputError(f"{where}: the reference is a bitdet train run, not a Megatron-LM launch")
    if os.path.abspath(spec.script) != os.path.abspath(script):
        raise BitdetInputError(f"{where}: the reference ran {spec.script}, not {os.path.abspath(script)}")
    ref, ours = rerun_args(list(spec.megatron_args)), rerun_args(list(megatron_args))
    if ref != ours:
        i = next((i for i, (a, b) in enumerate(zip(ref, ours)) if a != b), min(len(ref), len(ours)))
        raise BitdetInputError(f"{where}: the reference was launched with another line (output flags aside): from "
                               f"argument {i + 1} it reads {' '.join(ref[i:i + 3]) or '(end)'} where this one reads "
                               f"{' '.join(ours[i:i + 3]) or '(end)'}")
    if spec.nproc != nproc:
        raise BitdetInputError(f"{where}: the reference ran on {spec.nproc} ranks, not --nproc {nproc}")
    check_snapshots(reference, steps, nproc, f"make the reference with --snapshot-at {','.join(map(str, steps))}")


def line_recipe(megatron_args: list):
    """The line's ``--recipe`` with its ``--bitdet-override``s (None without one: native reductions)."""
    from megatron_bitdet.megatron_lm.entry import load_base_recipe
    from megatron_bitdet.megatron_lm.options import preparse

    return load_base_recipe(preparse(megatron_args))


def verify_megatron_resume(script: str, megatron_args: list, resume_at, *, nproc: int, out_dir,
                           skip_restore=(), reference_dir=None, full_snapshots: bool = False,
                           resume_nproc: int | None = None) -> ResumeReport:
    """``reference_dir``: reuse an uninterrupted run of the same launch line made with ``--snapshot-at``;
    ``full_snapshots``: every snapshot also keeps its tensors in full (``--snapshot-full all``);
    ``resume_nproc``: the resumed segments' world size (module docstring)."""
    from megatron_bitdet.megatron_lm.launch import launch_or_fail, pasted

    megatron_args = pasted(megatron_args, "verify-resume")
    if resume_nproc == nproc:
        resume_nproc = None
    if resume_nproc is not None:
        recipe = line_recipe(megatron_args)
        if recipe is None:
            raise BitdetInputError(f"--resume-nproc {resume_nproc}: the launch line has no --recipe, so it runs "
                                   "c10d's reductions, whose sums follow the data-parallel size: add --recipe R with "
                                   "determinism.reductions=dp_invariant determinism.virtual_dp=V, or drop --resume-nproc")
        check_other_dp(recipe, nproc, resume_nproc, "--resume-nproc")
    iterations = train_iters(megatron_args)
    steps = check_resume_at(resume_at, iterations)
    faults = skipped_restore_flags(skip_restore)
    out_dir = Path(out_dir)
    keep_all = ["--snapshot-full", "all"] if full_snapshots else []
    if reference_dir is None:
        reference = out_dir / "reference"
        fresh(reference)  # fingerprints append: a stale reference would mix in
        launch_or_fail(script, [*megatron_args, "--snapshot-at", ",".join(map(str, steps)), *keep_all], nproc=nproc,
                       run_dir=reference, what="reference run")
    else:
        reference = Path(reference_dir)
        _check_reference(reference, script, megatron_args, steps, nproc)

    def segment(run_dir: Path, start: int, stop: int, load_from: Path | None, full=None) -> None:
        """One segment, or with ``full`` (a selection file) a second-pass run: the snapshot at ``stop``
        (a fresh start) or right after restoring ``start``, with one step after it (Megatron-LM takes
        the snapshot as the next step begins), nothing saved."""
        fresh(run_dir)  # fingerprints append: a stale segment would mix in
        argv = list(megatron_args)
        if full is not None:
            argv += ["--exit-interval", str(stop + 1), "--snapshot-full", str(full)]
            argv += [] if load_from else ["--snapshot-at", str(stop)]
        else:
            if stop != iterations:
                argv += ["--save", str(run_dir / "checkpoints"), "--save-interval", str(stop),
                         "--exit-interval", str(stop)]
            argv += keep_all if load_from is not None else []
        if load_from is not None:
            argv += ["--load", str(load_from / "checkpoints"), "--ckpt-step", str(start),
                     "--snapshot-at", str(start), *faults, *([ACCEPT_FLAG] if faults else [])]
        what = f"segment {start}->{stop}" + (" (second pass)" if full is not None else "")
        launch_or_fail(script, argv, nproc=resume_nproc or nproc if load_from is not None else nproc,
                       run_dir=run_dir, what=what)

    return run_chain(segment, name=Path(script).name, steps=steps, iterations=iterations, nproc=resume_nproc or nproc,
                     out_dir=out_dir, reference_dir=reference, faults=faults,
                     reference_ranks=None if resume_nproc is None else [0] * resume_nproc)
