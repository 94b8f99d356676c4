"""One rank of ``bitdet train``: enforce, set up, optionally resume, run the steps, clean up."""
from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

import torch

from megatron_bitdet.train.console import Console

# Known, understood noise from megatron-core on this stack (GPU extras absent by design).
_QUIET = [
    (UserWarning, r"(Transformer Engine|Apex) (and Apex are|is) not installed"),
    (UserWarning, r"full scope is deprecated"),
    (UserWarning, r"The \.grad attribute of a Tensor that is not a leaf"),
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
]
_ENFORCEMENT = {}


def enforce(rank: int, world_size: int, *, recipe: dict, **_unused) -> None:
    """Runs before the process group exists (the launcher's ``before_process_group`` hook), so a
    late application is impossible by construction."""
    from megatron_bitdet.enforce import enable
    from megatron_bitdet.recipe import Recipe

    for category, message in _QUIET:
        warnings.filterwarnings("ignore", message=message, category=category)
    logging.getLogger("megatron.core.ssm.mamba_mixer").setLevel(logging.ERROR)
    recipe = Recipe.from_dict(recipe, source="<run recipe>")
    enforcement = enable(recipe, rank=rank, world_size=world_size)
    for warning in enforcement.warnings:
        print(f"[bitdet] warning: {warning}", file=sys.stderr, flush=True)
    _ENFORCEMENT.update(recipe=recipe, enforcement=enforcement)


def enforced() -> tuple:
    """(recipe, enforcement) as ``enforce`` left them in this process (rank-side workers read them)."""
    if not _ENFORCEMENT:
        raise RuntimeError("enforce() has not run in this process")
    return _ENFORCEMENT["recipe"], _ENFORCEMENT["enforcement"]


def worker(rank: int, world_size: int, *, recipe: dict, options: dict, hooks=()) -> int:
    """``options``: ``train.run.RunOptions.to_json()``; ``hooks``: ``train.loop.StepHook`` objects, from a
    rank entry that wraps this one in-process (replay)."""
    from megatron_bitdet.train.launch import collector_paused

    with collector_paused():  # imports, model, data: long-lived objects
        from megatron.core import parallel_state as ps

        from megatron_bitdet.enforce import build_manifest, write_manifest
        from megatron_bitdet.enforce.manifest import gather_placement
        from megatron_bitdet.model.builder import load_model_provider
        from megatron_bitdet.rundir import checkpoints_dir, fingerprints_dir
        from megatron_bitdet.train import checkpoint
        from megatron_bitdet.train.data import build_train_data
        from megatron_bitdet.train.loop import train_steps
        from megatron_bitdet.train.run import RunOptions
        from megatron_bitdet.train.setup import setup
        from megatron_bitdet.train.module_state import restore_module_rng
        from megatron_bitdet.train.snapshot import inject_restore_faults, read_selection, take_snapshot
        from megatron_bitdet.train.step_fingerprints import replica_coverage
        from megatron_bitdet.train.tracing import make_tracer

        if not _ENFORCEMENT:
            enforce(rank, world_size, recipe=recipe)
        recipe, enforcement = enforced()
        opts = RunOptions.from_json(options)
        provider = load_model_provider(opts.model_provider)
        state = setup(recipe, enforcement, provider=provider)
        run_dir = Path(opts.run_dir)
        manifest = build_manifest(
            recipe, enforcement, world_size=world_size, argv=None if opts.argv is None else list(opts.argv),
            placement=gather_placement(), model_provider=opts.model_provider,
            extra={"patches": state.patches, "cpu_backend_seams": state.cpu_seams,
                   "model_provider": opts.model_provider, "trace": options["trace"],
                   "replica_check": replica_coverage(state.ddp_modules)},
        )
        if rank == 0:
            write_manifest(run_dir, manifest)
        t = recipe.training
        dp_size = ps.get_data_parallel_world_size()
        data = build_train_data(
            recipe.data, seq_length=recipe.model.seq_length, seed=t.seed, micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size, dp_rank=ps.get_data_parallel_rank(), dp_size=dp_size,
            train_samples=t.iterations * t.global_batch_size, virtual_dp=recipe.determinism.virtual_dp,
        )
    console = Console(active=rank == world_size - 1, total=t.iterations)
    start = 0
    snapshot_at = set(opts.snapshot_at)
    snapshot_full = read_selection(opts.snapshot_full)  # a bad selection file: exit 2 before any step
    faults = list(opts.fault_skip_restore)
    load = opts.load
    if load:
        fresh = {"scheduler": state.scheduler.state_dict(), "data": data.state_dict()}
        start, rank_state = checkpoint.load_checkpoint(
            load, ddp_modules=state.ddp_modules, optimizer=state.optimizer, scheduler=state.scheduler,
            world_size=world_size,
        )
        checkpoint.restore_rng(rank_state["rng"], skip=frozenset(f[4:] for f in faults if f.startswith("rng.")))
        if "rng.module" not in faults:
            restore_module_rng([m.module for m in state.ddp_modules], rank_state.get("module_rng"), source=load)
        data.load_state_dict(rank_state["data"])
        if faults:
            inject_restore_faults(faults, ddp_modules=state.ddp_modules, optimizer=state.optimizer,
                                  scheduler_state_before=fresh["scheduler"], scheduler=state.scheduler, data=data,
                                  data_state_before=fresh["data"])
            console.note(f"FAULT INJECTION: restore skipped {', '.join(faults)}")
        console.note(f"resumed from {load} at iteration {start}")
        if start in snapshot_at:
            take_snapshot(run_dir, start, rank=rank, ddp_modules=state.ddp_modules, optimizer=state.optimizer,
                          scheduler=state.scheduler, data=data, full=snapshot_full)
    save_interval = opts.save_interval or 0
    save_root = opts.save or (str(checkpoints_dir(run_dir)) if save_interval else None)
    stop = min(opts.stop_at or t.iterations, t.iterations)
    tracer = make_tracer(opts.trace, run_dir, rank, world_size, state.ddp_modules, manifest["recipe_digest"])
    try:
        train_steps(state, data, run_dir=run_dir, start=start, stop=stop, save_root=save_root,
                    save_interval=save_interval, manifest=manifest, console=console,
                    snapshot_at=snapshot_at - {start}, snapshot_full=snapshot_full, tracer=tracer, hooks=hooks)
    finally:
        console.close()
        if tracer is not None:
            tracer.close()
    console.note(f"fingerprints: {fingerprints_dir(run_dir)}" + (f" | checkpoints: {save_root}" if save_root else ""))
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    return 0


worker.before_process_group = enforce
