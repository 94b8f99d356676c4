"""Start N local ranks of a Megatron-LM script under the entry point (``train.launch``, as ``bitdet train``)."""
from __future__ import annotations

import os
import sys

from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.megatron_lm.line_rules import RESTORE_FLAGS, RESTORE_SWITCHES

# how a launch stops besides its schedule: a re-run or a workflow stops where it says instead (a fixed length)
_STOP_FLAGS = ("--exit-interval", "--exit-duration-in-mins", "--exit-signal-handler", "--exit-signal")
# a re-run writes into its own run directory only: the original's outputs and tracing are not carried over
# (a name ending in "-" is a prefix: every --wandb-* flag); what it loads stays (a resumed run re-runs resumed)
_OUTPUT_FLAGS = ("--run-dir", "--snapshot-at", "--snapshot-full", "--trace", "--trace-steps", "--trace-ranks",
                 "--trace-hash", "--trace-capture", "--save", "--save-interval", "--persistent-save-interval",
                 *_STOP_FLAGS, "--tensorboard-dir", "--wandb-")
# a workflow that chains fresh launches (verify-resume, prove) also sets what each one loads, and restores
# everything it saved (the restore-skipping flags of line_rules go)
_WORKFLOW_FLAGS = (*_OUTPUT_FLAGS, "--load", "--ckpt-step", *(flag for _, _, flag, _, _ in RESTORE_FLAGS),
                   "--accept-skipped-restore")
# flags of those that take no value
_SWITCHES = ("--exit-signal-handler", "--accept-skipped-restore", *RESTORE_SWITCHES)
_NOTES = {**{flag: "each launch restores everything its checkpoint holds"
             for flag in (*(f for _, _, f, _, _ in RESTORE_FLAGS), "--accept-skipped-restore")},
          **{flag: "each launch stops where the workflow says (a fixed length)" for flag in _STOP_FLAGS}}


def _named(name: str, flags) -> bool:
    return any(name == f or (f.endswith("-") and name.startswith(f)) for f in flags)


def pasted(megatron_args: list, workflow: str) -> list[str]:
    """A pasted production line for a workflow that sets each launch's outputs, loads and length itself
    (verify-resume, prove): its output flags (checkpoints, what it loads, TensorBoard, W&B, run directory),
    its stop conditions (``--exit-interval``, a wall-clock or signal stop) and the flags that skip restored
    state (``line_rules.RESTORE_FLAGS``) are dropped, each with a one-line note on stderr, never refused."""
    kept = rerun_args(megatron_args, drop=_WORKFLOW_FLAGS)
    names = [a.split("=", 1)[0] for a in megatron_args if a.startswith("--")]
    for flag in dict.fromkeys(n for n in names if _named(n, _WORKFLOW_FLAGS)):
        why = _NOTES.get(flag, "each launch writes its own outputs (run directory, checkpoints) where the workflow "
                               "says")
        print(f"[bitdet] note: {workflow} drops {flag} from the line: {why}", file=sys.stderr, flush=True)
    return kept


def preflight(script: str, megatron_args: list, *, nproc: int) -> None:
    """The line judged in this process as its ranks will judge it, before any starts: BitdetInputError
    (exit 2) listing every determinism violation (with ``--deterministic-mode``) and every flag this
    machine cannot run. Megatron's own output while parsing is not shown. Under torchrun the ranks
    already exist and judge themselves."""
    import contextlib
    import io

    from megatron_bitdet.megatron_lm import entry
    from megatron_bitdet.train.launch import under_torchrun

    if under_torchrun():
        return
    argv, err = sys.argv, io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = entry.run(script, rerun_args(megatron_args, drop=("--run-dir",)), world_size=nproc, preflight=True)
    finally:
        sys.argv = argv
    if rc != 0:  # the script exited before its pretrain() call judged the line
        last = next((line for line in reversed(err.getvalue().splitlines()) if line.strip()), "")
        raise BitdetInputError(f"no rank started: {os.path.basename(script)} exited with code {rc} before its "
                               f"launch line was judged" + (f": {last.strip()}" if last else ""))


def launch_line(script: str, megatron_args: list, *, nproc: int, run_dir=None, worker: str | None = None,
                worker_args: dict | None = None) -> int:
    """Run ``script`` on ``nproc`` ranks; the canonical env is in each rank's environment from its
    first instruction (with ``--deterministic-mode``). Bad bitdet options (tracing flags included),
    determinism violations and flags this machine cannot run exit 2 before any rank starts
    (``preflight``). ``worker``: another rank worker taking ``entry.rank_worker``'s arguments plus
    ``worker_args`` (``bitdet replay``'s, which adds step hooks). Returns the exit code."""
    from megatron_bitdet.megatron_lm import entry
    from megatron_bitdet.megatron_lm.options import DEFAULT_RUN_DIR, preparse
    from megatron_bitdet.trace.options import trace_settings
    from megatron_bitdet.train.launch import launch

    entry.split_argv([script])  # the script must exist: exit 2 before any rank starts
    argv = list(megatron_args) + (["--run-dir", str(run_dir)] if run_dir else [])
    opts = preparse(argv)
    trace_settings(opts)
    env = {"PYTHONUNBUFFERED": "1"}
    base = entry.load_base_recipe(opts)
    if opts.deterministic_mode:
        env.update(entry.canonical_env(base))
    preflight(script, argv, nproc=nproc)
    return launch(worker or "megatron_bitdet.megatron_lm.entry:rank_worker", nproc,
                  {"script": os.path.abspath(script), "argv": argv, **(worker_args or {})},
                  run_dir=opts.run_dir or DEFAULT_RUN_DIR, env=env, console_rank=-1)


def launch_or_fail(script: str, megatron_args: list, *, nproc: int, run_dir, what: str) -> None:
    rc = launch_line(script, megatron_args, nproc=nproc, run_dir=run_dir)
    if rc != 0:
        raise BitdetError(f"{what} failed (exit code {rc}); logs: {os.path.join(str(run_dir), 'logs')}")


def rerun_args(megatron_args: list, *, stop_at: int | None = None, trace=None,
               drop: tuple = _OUTPUT_FLAGS) -> list[str]:
    """A finished run's launch line for a re-run into another directory (the localize ladder): the
    original's output flags (run directory, checkpoints, TensorBoard, snapshots, tracing) dropped,
    Megatron's ``--exit-interval`` stopping it after iteration ``stop_at``, and ``trace`` (a TraceConfig)
    as tracing flags. The model, data and schedule flags stay as they were (``--train-iters`` too: the
    learning-rate schedule depends on it). ``drop``: the flags taken out with their values (default: the
    output flags)."""
    from megatron_bitdet.trace.options import trace_flags

    out, skip = [], False
    for arg in megatron_args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if arg.startswith("--") and _named(name, drop):
            skip = "=" not in arg and name not in _SWITCHES
            continue
        out.append(arg)
    if stop_at is not None:
        out += ["--exit-interval", str(stop_at)]
    return out + trace_flags(trace)
