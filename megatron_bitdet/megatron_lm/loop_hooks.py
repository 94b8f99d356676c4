"""Hooks on Megatron-LM's own seams (``megatron.training``), installed before the script runs.

- the call taking the launch line (``compat.args_entry``: ``pretrain`` before megatron-core 0.18,
  ``arguments.parse_and_validate_args`` from 0.18): bitdet's arguments are chained into whatever
  ``extra_args_provider`` the script passes; under ``--check`` (and a launch's preflight, before any rank
  starts) the parsed launch line is judged (``judging``) and nothing trains.
- ``validate_args`` (the binding that call reaches): before Megatron's one-at-a-time asserts, the line is judged as ``--check``
  judges it (``judging.judge_line``: a validated copy of the args becomes the run's recipe); enforcement is
  enabled and the swaps are installed — into the spec object itself where it holds what a swap replaces —
  before any process group or model exists; the manifest is written once Megatron's own ``validate_args``
  accepted the real args. Before the first step the built chunks are audited again (``rules.built`` in the
  manifest).
- ``build_train_valid_test_data_iterators``: creating the DataLoader iterator draws a seed from the CPU
  generator, which on CPU is also the generator dropout draws from; it draws on a saved-and-restored
  state here, so a resumed run's dropout stream equals the uninterrupted run's.
- ``train_step``: one fingerprint line per step on every rank (the writer and the device digests
  ``bitdet train`` uses: launched in the step, read back after it), and
  the step's wall time in a file of its own (``timings``: the tax of a launch line); with ``--trace`` the
  steps in the window are traced as ``bitdet train`` traces them (``train.tracing``: phases forward /
  backward inside Megatron's forward_backward_func, grad_reduce, optimizer; bookkeeping untraced).
- checkpoint RNG states: each EP rank saves and restores its own (``compat.rng_checkpoint``: 0.17+ keeps DP
  rank 0's only).
- checkpoint load: megatron-core 0.16.1's distributed optimizer with torch's Adam (the same two step
  bugs ``bitdet train`` works around).
- ``STEP_HOOKS``: ``train.loop.StepHook``s a rank worker adds before the script runs (``bitdet replay``'s
  module statistics and counterfactual changes), called around each step as bitdet's loop calls them
  (``begin`` may replace the step's data iterator; ``end`` gets the step's fingerprint line, and a stop
  request is not honoured: Megatron-LM stops at ``--exit-interval``).
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_bitdet.errors import BitdetInputError, DeterminismViolation
from megatron_bitdet.megatron_lm.judging import (CheckDone, chain, check_launch, judge_line, launch_manifest, preflight,
                                                 swap_spec)

@dataclass
class Session:
    """What one rank's hooks share: the launch, the recipe judged, the writer."""

    script: str
    argv: list
    base: object
    opts: object
    check: bool = False
    recipe: object = None
    enforcement: object = None
    manifest: dict = field(default_factory=dict)
    patches: list = field(default_factory=list)
    writer: object = None
    rank: int = 0
    digests: object = None               # this rank's StepDigests, made at the first step
    iteration: int = 0                   # the step in flight (from 1)
    lr: float | None = None
    model: list | None = None
    clock: object = None
    tracer: object = None                # this rank's Tracer (--trace), made at the first step
    traced: object = None                # the tracer while a step inside its window runs, else None
    built: dict | None = None            # the built-model audit (rule id -> what runs), after the build
    world_size: int | None = None        # a --check's world (the launch's --nproc; None: the environment's)
    preflight: bool = False              # judge as the ranks will, before any starts (bitdet megatron-lm --nproc)
    virtual: object = None               # dp_invariant: this rank's virtual_ranks.VirtualSteps, made at the first step

    @property
    def trace(self):
        """The launch line's tracing flags as a TraceConfig (None: tracing off)."""
        from megatron_bitdet.trace.options import trace_settings

        return trace_settings(self.opts)

    @property
    def snapshot_at(self) -> frozenset:
        return frozenset(int(k) for k in (self.opts.snapshot_at or "").split(",") if k.strip())

    @property
    def run_dir(self) -> Path:
        from megatron_bitdet.megatron_lm.options import DEFAULT_RUN_DIR

        return Path(self.opts.run_dir or DEFAULT_RUN_DIR)

    def step_clock(self):
        """The step timer, made on first use (inside ``train_step``: the process group exists)."""
        if self.clock is None:
            import torch

            from megatron_bitdet.megatron_lm.timings import StepClock

            self.clock = StepClock(self.run_dir, torch.distributed.get_rank())
        return self.clock

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.clock is not None:
            self.clock.close()
        if self.tracer is not None:
            self.tracer.close()
            self.tracer = None


def on_validate(session, args, defaults=None) -> None:
    """Judge and enforce on a copy of the args as Megatron validates them, install the swaps, make the
    manifest (written once Megatron's own validate_args accepted the real args)."""
    from megatron_bitdet.compat import patching
    from megatron_bitdet.enforce import Enforcement, enable, megatron_overrides
    from megatron_bitdet.megatron_lm.line_rules import line_judgement
    from megatron_bitdet.megatron_lm.machine import section

    session.rank = args.rank
    checked, recipe, judged, _, rows = judge_line(session, args, _ORIGINALS["validate_args"], defaults)
    session.recipe = recipe
    if judged is not None and judged[2]:
        raise DeterminismViolation(judged[2])
    if rows:
        raise BitdetInputError(section(rows))
    if judged is None:
        import torch

        enforcement = Enforcement(mode=False, threads=torch.get_num_threads(),
                                  warnings=["--deterministic-mode not given: nothing enforced"])
    else:
        enforcement = enable(recipe, rank=args.rank, world_size=args.world_size)
        enforcement.rules.opt_outs += line_judgement(checked, recipe)[1]  # the line's own, accepted on it
        for name, value in megatron_overrides(recipe).items():
            setattr(args, name, value)  # core_transformer_config_from_args copies every config field args has
    session.enforcement = enforcement
    for warning in enforcement.warnings:
        print(f"[bitdet] warning: {warning}", file=sys.stderr, flush=True)
    session.patches = patching.apply_for(recipe, family=recipe.model.spec, swaps=enforcement.rules.swaps)
    if recipe.determinism.reductions != "native":  # the recipe's reductions, as bitdet train's setup
        from megatron_bitdet.train import reductions

        session.patches = [*session.patches, reductions.install(recipe.determinism.reductions)]
    if judged is not None:
        swap_spec(recipe, args, enforcement.rules, in_place=True, config=args)
    session.manifest = launch_manifest(session, enforcement, args)


def audit_built(session, model) -> None:
    """After the build, before the first step: the rules judge what the built chunks hold and call
    (every violation at once); the manifest records it per rule (``rules.built``), and what the layout
    lets ``bitdet check`` cover (``replica_check``)."""
    import torch

    from megatron_bitdet.enforce import plan, write_manifest
    from megatron_bitdet.enforce.audit import by_rule, runs_record, walk_built
    from megatron_bitdet.train.step_fingerprints import replica_coverage

    findings = walk_built(model)
    violations = plan(session.recipe, late=False, runs=by_rule(findings))[2]
    if violations:
        raise DeterminismViolation(violations)
    session.built = runs_record(findings)
    session.manifest["rules"]["built"] = session.built
    session.manifest["replica_check"] = replica_coverage(model)
    if torch.distributed.get_rank() == 0:
        write_manifest(session.run_dir, session.manifest)


def start_virtual_ranks(session, model) -> None:
    """dp_invariant: this rank's virtual layout (buckets scaled by 1/V), recorded in the manifest's
    reductions record as ``bitdet train`` records it."""
    from megatron_bitdet.megatron_lm.virtual_ranks import VirtualSteps
    from megatron_bitdet.train.step_fingerprints import ddp_buffers

    session.virtual = VirtualSteps(session.recipe, model)
    grad_bytes = sum(g.numel() * g.element_size() for g in ddp_buffers(model, "grad_data"))
    session.patches[-1]["virtual_layout"] = session.virtual.virtual.record(grad_bytes)
    session.manifest["patches"] = session.patches


def _wrap_optimizer_step(session, optimizer) -> None:
    """The grads' digests are launched (untraced, on their device, no host sync: part of the step's
    time) right before the optimizer consumes them; lr is the one the step used; in a traced step the
    step itself is the ``optimizer`` phase, as in ``bitdet train``."""
    if getattr(optimizer, "_bitdet_wrapped", False):
        return
    from megatron_bitdet.train.step_fingerprints import StepDigests
    from megatron_bitdet.train.tracing import traced_optimizer_step, untraced

    original = optimizer.step
    model = session.model
    session.digests = StepDigests(model, optimizer=optimizer, logical_digests=session.virtual is not None)

    def step(*a, **kw):
        with untraced(session.traced):
            session.digests.grads(session.iteration)
        session.lr = optimizer.param_groups[0]["lr"]
        return traced_optimizer_step(session.traced, optimizer, model, lambda: original(*a, **kw))

    optimizer.step = step
    optimizer._bitdet_wrapped = True


class UntracedBatches:
    """The training DataLoader's iterator with every ``next()`` outside the trace: with ``--num-workers``
    the main process rebuilds the batches its worker processes deliver in arrival order (prefetched ones
    too), so which tensors a traced step rebuilds is timing. The batch itself is in the trace as the
    inputs of the ops that consume it."""

    def __init__(self, iterable, session):
        self.iterable, self.session = iterable, session

    def __iter__(self):
        return self

    def __next__(self):
        from megatron_bitdet.train.tracing import untraced

        with untraced(self.session.traced):
            return next(self.iterable)


def rank_tracer(session, model):
    """This rank's Tracer over the chunks Megatron built (``--trace``; None without), made at the first step."""
    if session.tracer is None and session.trace is not None:
        import torch

        from megatron_bitdet.train.tracing import make_tracer

        session.tracer = make_tracer(session.trace, session.run_dir, torch.distributed.get_rank(),
                                     torch.distributed.get_world_size(), model, session.manifest.get("recipe_digest"))
    return session.tracer


def on_step_end(session, step: int, result) -> dict | None:
    """The step's line: metrics, and the digests launched in the step and now (read back here); returns
    it as written (None for a step cut short)."""
    import torch
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    from megatron_bitdet.fingerprint.steps import StepFingerprintWriter
    from megatron_bitdet.train.step_fingerprints import moe_aux_losses, step_metrics

    loss_dict, _skipped, _ckpt, should_exit, _code, grad_norm, num_zeros = result[:7]
    if should_exit and not loss_dict:
        session.digests.resolve()  # a step cut short: its grads' digests are dropped with it
        return
    session.digests.state(step)
    args = get_args()
    if session.writer is None:
        session.writer = StepFingerprintWriter(session.run_dir, torch.distributed.get_rank())
    lm = loss_dict.get("lm loss") if loss_dict else None
    aux = moe_aux_losses(get_num_microbatches(), clear=False) if args.num_experts else {}
    coeff = args.moe_aux_loss_coeff
    coeff = coeff[0] if isinstance(coeff, (list, tuple)) else (coeff or 0.0)
    metrics = step_metrics(lm_loss=None if lm is None else lm.detach().to(torch.float32), aux=aux, aux_coeff=coeff,
                           grad_norm=grad_norm, lr=session.lr, num_zeros=num_zeros)
    return session.writer.write(step, metrics, *session.digests.resolve())


_ORIGINALS: dict = {}
STEP_HOOKS: list = []  # this rank's step hooks (a rank worker adds them before the script runs)


@dataclass
class StepState:
    """What a step hook reads of the step, named as in bitdet's loop: the chunks Megatron built, the
    model config (its ``finalize_model_grads_func`` included) and the run's recipe."""

    ddp_modules: list
    config: object
    recipe: object


class DataPosition:
    """Megatron-LM's data position (consumed samples), as the snapshot's ``data`` component."""

    def state_dict(self) -> dict:
        from megatron.training import get_args

        args = get_args()
        return {"consumed_train_samples": int(args.consumed_train_samples),
                "skipped_train_samples": int(getattr(args, "skipped_train_samples", 0))}


def snapshot(session, iteration: int, model, optimizer, scheduler) -> None:
    """The live state after ``iteration`` steps, taken as step ``iteration + 1`` begins — in the
    uninterrupted run and right after a restore alike (same point, same objects). With
    ``--overlap-param-gather`` the parameter all-gather the step's forward would wait on is done first: a
    restored state holds gathered parameters, and the gather's bits are the same either way."""
    import torch

    from megatron_bitdet.train.snapshot import take_snapshot

    for chunk in model:
        if chunk.ddp_config.use_distributed_optimizer and chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
    take_snapshot(session.run_dir, iteration, rank=torch.distributed.get_rank(), ddp_modules=model,
                  optimizer=optimizer, scheduler=scheduler, data=DataPosition(), full=session.opts.snapshot_full)


def load_with_adam_fix(original, ddp_model, optimizer, *a, **kw):
    """Megatron-LM's load_checkpoint with megatron-core 0.16.1's two torch-Adam step bugs fixed (as
    ``bitdet train`` does): states exist (with a step) before the shards are described, and each param
    gets its own copy of the saved step afterwards."""
    from megatron_bitdet.compat.checkpoint import load_optimizer_state, prepare_optimizer_for_load

    if optimizer is None:
        return original(ddp_model, optimizer, *a, **kw)
    prepare_optimizer_for_load(optimizer)

    def load_state_dict(state_dict):
        del optimizer.load_state_dict  # the class's method again, for compat's loader
        load_optimizer_state(optimizer, state_dict)

    optimizer.load_state_dict = load_state_dict
    try:
        return original(ddp_model, optimizer, *a, **kw)
    finally:
        optimizer.__dict__.pop("load_state_dict", None)


def install(session: Session) -> None:
    """Wrap Megatron-LM's seams for this session (a later session in the same process, e.g. a second
    ``--check``, replaces the earlier one's wrappers instead of stacking on them)."""
    from megatron.training import training

    from megatron_bitdet.compat import args_entry, rng_checkpoint
    from megatron_bitdet.train.tracing import traced_step

    rng_checkpoint.install()
    line_seam, validate_seam = args_entry.line_entry(), args_entry.validate_args()
    if not _ORIGINALS:
        _ORIGINALS.update(line_entry=line_seam.original(), validate_args=validate_seam.original(),
                          iterators=training.build_train_valid_test_data_iterators, train_step=training.train_step,
                          load_checkpoint=training.load_checkpoint)
    original_entry = _ORIGINALS["line_entry"]

    @functools.wraps(original_entry)
    def line_entry(*a, extra_args_provider=None, **kw):
        if session.preflight:
            raise CheckDone(preflight(session, extra_args_provider, _ORIGINALS["validate_args"],
                                       kw.get("args_defaults")))
        if session.check:
            raise CheckDone(check_launch(session, extra_args_provider, _ORIGINALS["validate_args"],
                                          kw.get("args_defaults")))
        return original_entry(*a, extra_args_provider=chain(extra_args_provider), **kw)

    original_validate = _ORIGINALS["validate_args"]

    @functools.wraps(original_validate)
    def validate_args(args, defaults={}):  # noqa: B006 - Megatron's signature
        on_validate(session, args, defaults)
        result = original_validate(args, defaults)
        if not args.async_save:  # as validated: Megatron turns it off where it cannot run
            from megatron_bitdet.compat.checkpoint import in_process_write_results

            in_process_write_results()
        if args.rank == 0:  # after Megatron's own asserts: a manifest exists only for a line Megatron accepted
            from megatron_bitdet.enforce import write_manifest

            write_manifest(session.run_dir, session.manifest)
        return result

    original_iterators = _ORIGINALS["iterators"]

    @functools.wraps(original_iterators)
    def build_train_valid_test_data_iterators(*a, **kw):
        import torch

        state = torch.get_rng_state()
        try:
            train, *rest = original_iterators(*a, **kw)
        finally:
            torch.set_rng_state(state)
        for it in (train if isinstance(train, list) else [train]) if session.trace is not None else ():
            if it is not None:
                it.iterable = UntracedBatches(it.iterable, session)
        return (train, *rest)

    original_step = _ORIGINALS["train_step"]

    @functools.wraps(original_step)
    def train_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, *a, iteration=None,
                   **kw):
        session.model, session.iteration = model, iteration + 1
        if session.virtual is None and session.recipe.determinism.reductions == "dp_invariant":
            start_virtual_ranks(session, model)
        if session.built is None and session.enforcement is not None and session.enforcement.mode:
            audit_built(session, model)
        _wrap_optimizer_step(session, optimizer)
        if iteration in session.snapshot_at:
            snapshot(session, iteration, model, optimizer, scheduler)
        state = StepState(model, config, session.recipe) if STEP_HOOKS else None
        for hook in STEP_HOOKS:
            data_iterator = hook.begin(iteration + 1, state, data_iterator)
        with traced_step(rank_tracer(session, model), config, model, iteration + 1) as session.traced:
            try:
                session.step_clock().start()
                if session.virtual is not None:  # Megatron's forward_backward_func, the argument after config
                    a = (session.virtual.forward_backward(a[0], config), *a[1:])
                result = original_step(forward_step_func, data_iterator, model, optimizer, scheduler, config, *a,
                                       iteration=iteration, **kw)
                if session.virtual is not None:
                    result = session.virtual.step_result(result)
                session.clock.stop(iteration + 1)
            finally:
                session.traced = None
        line = on_step_end(session, iteration + 1, result)
        for hook in STEP_HOOKS if line is not None else ():
            hook.end(iteration + 1, line)
        return result

    original_load = _ORIGINALS["load_checkpoint"]

    @functools.wraps(original_load)
    def load_checkpoint(ddp_model, optimizer, *a, **kw):
        return load_with_adam_fix(original_load, ddp_model, optimizer, *a, **kw)

    line_seam.replace(line_entry)
    validate_seam.replace(validate_args)
    training.build_train_valid_test_data_iterators = build_train_valid_test_data_iterators
    training.train_step = train_step
    training.load_checkpoint = load_checkpoint
