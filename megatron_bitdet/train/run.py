"""The public run API: one training run of a recipe, used by the CLI, the workflows and the tests.

``launch_training(recipe, RunOptions(nproc=2, run_dir=...))`` checks the parallel layout, builds the
ranks' determinism environment and starts ``train.worker`` on every rank; the options travel to the
ranks as one JSON object (``RunOptions.to_json``), so the run's settings are spelled out once.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, fields, replace

from megatron_bitdet.errors import BitdetInputError, DeterminismViolation
from megatron_bitdet.rundir import fresh, make_dir
from megatron_bitdet.trace import TraceConfig

WORKER = "megatron_bitdet.train.worker:worker"


@dataclass(frozen=True)
class RunOptions:
    """Everything about one run except the recipe."""

    nproc: int
    run_dir: str
    save: str | None = None              # checkpoint root (default RUN_DIR/checkpoints)
    save_interval: int | None = None     # None: the recipe's checkpoint.save_interval
    load: str | None = None              # a checkpoint root (its 'latest') or one iter_N dir
    model_provider: str | None = None    # MODULE:FUNC
    stop_at: int | None = None           # stop after this iteration (an interruption)
    argv: tuple[str, ...] | None = None  # recorded in the manifest
    snapshot_at: tuple[int, ...] = ()    # live-state snapshots after these iterations (verify-resume)
    snapshot_full: str | None = None     # tensors the snapshots keep in full: "all" or a selection file
    fault_skip_restore: tuple[str, ...] = ()  # TEST ONLY: restores skip these components
    trace: TraceConfig | None = None     # None: tracing off, nothing installed
    fresh: bool = False                  # empty run_dir first (rundir.fresh): nothing stale mixes in

    def __post_init__(self):
        object.__setattr__(self, "run_dir", str(self.run_dir))
        for name in ("snapshot_at", "fault_skip_restore"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.argv is not None:
            object.__setattr__(self, "argv", tuple(self.argv))

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(snapshot_at=list(self.snapshot_at), fault_skip_restore=list(self.fault_skip_restore),
                 argv=None if self.argv is None else list(self.argv),
                 trace=None if self.trace is None else self.trace.to_json())
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RunOptions":
        trace = d.get("trace")
        return cls(**{**d, "trace": None if trace is None else TraceConfig.from_json(trace)})


def check_layout(recipe, nproc: int) -> None:
    """Refuse a layout megatron-core would reject, before any rank starts (exit 2, not a rank traceback)."""
    p = recipe.parallel
    if recipe.model.has("E") and p.tensor > 1 and not p.sequence_parallel:
        raise BitdetInputError(f"parallel.tensor={p.tensor} with MoE layers needs parallel.sequence_parallel=true "
                               "(megatron-core refuses MoE with tensor parallelism but without sequence parallelism)")
    model_parallel = p.tensor * p.pipeline * p.context
    if nproc % model_parallel:
        raise BitdetInputError(f"--nproc {nproc} is not divisible by tensor x pipeline x context = {model_parallel}")
    if recipe.model.moe.num_experts:
        expert_parallel = p.expert * p.expert_tensor * p.pipeline
        if nproc % expert_parallel:
            raise BitdetInputError(
                f"--nproc {nproc} is not divisible by expert x expert_tensor x pipeline = {expert_parallel}"
            )
        if recipe.model.moe.num_experts % p.expert:
            raise BitdetInputError(f"model.moe.num_experts={recipe.model.moe.num_experts} is not divisible by "
                                   f"parallel.expert={p.expert}")
    dp = nproc // model_parallel
    if issue := recipe.determinism.virtual_dp_issue(dp):
        raise BitdetInputError(issue)
    t = recipe.training
    if t.lr_schedule.warmup_iters >= t.iterations:
        raise BitdetInputError(f"training.lr_schedule.warmup_iters={t.lr_schedule.warmup_iters} must be < "
                               f"training.iterations={t.iterations} (megatron's scheduler needs decay steps)")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise BitdetInputError(f"training.global_batch_size={t.global_batch_size} is not divisible by "
                               f"micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp}")


def child_env(recipe) -> dict:
    """The canonical determinism environment, validated here and handed to every rank before its
    interpreter starts (NCCL, cuBLAS and TE read these at first use)."""
    from megatron_bitdet.enforce import plan
    from megatron_bitdet.enforce.env import effective_env

    env = {"PYTHONUNBUFFERED": "1"}
    if sys.stdout.isatty():
        env["BITDET_INTERACTIVE"] = "1"
    if not recipe.determinism.mode:
        return env
    settings, _, violations, _ = plan(recipe, late=False)
    if violations:
        raise DeterminismViolation(violations)
    env.update(effective_env(settings))
    return env


def launch_training(recipe, options: RunOptions, *, worker: str = WORKER, worker_args: dict | None = None) -> int:
    """Train ``recipe`` on ``options.nproc`` local ranks (or join torchrun); returns the exit code.
    ``worker``: a rank entry wrapping ``train.worker.worker`` (replay), also given ``worker_args``."""
    from megatron_bitdet.train.launch import launch

    check_layout(recipe, options.nproc)
    if options.fresh:
        fresh(options.run_dir)
    make_dir(options.run_dir)
    if options.save_interval is None:
        options = replace(options, save_interval=recipe.checkpoint.save_interval)
    return launch(worker, options.nproc, {"recipe": recipe.to_dict(), "options": options.to_json(),
                                          **(worker_args or {})},
                  run_dir=options.run_dir, env=child_env(recipe), console_rank=-1)
