"""Live-state snapshots for checkpoint-resume validation.

The reference run snapshots its in-memory state after step K; a resumed run snapshots right after
restoring K. Both come from the live objects, not from the checkpoint files, so a restore that skips
or mangles a component shows up as a difference. Contents are tensors, numbers and strings only
(loaded with ``weights_only=True``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.rundir import load_tensors, snapshot_path
from megatron_bitdet.train import precision
from megatron_bitdet.train.checkpoint import capture_rng
from megatron_bitdet.train.module_state import capture_module_rng, module_buffers

# Restore components a fault-injection test may skip (``--fault-skip-restore``); never set in real runs.
# compute_copy.rounding: the bf16 compute copy converted from the fp32 source rounding toward zero;
# fp8.amax_history: the FP8 delayed-scaling state left fresh.
FAULTS = ("rng.python", "rng.numpy", "rng.torch_cpu", "rng.tracker", "rng.module", "data", "optimizer.exp_avg",
          "scheduler", "compute_copy.rounding", "fp8.amax_history")


def _optimizer_state(optimizer) -> dict:
    out = {}
    for oi, opt in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = opt.optimizer
        for gi, group in enumerate(inner.param_groups):
            prefix = f"optimizer{oi}.group{gi}"
            for key, value in group.items():
                if key != "params" and isinstance(value, (int, float, bool, tuple)):
                    out[f"{prefix}.{key}"] = value
            for pi, param in enumerate(group["params"]):
                out[f"{prefix}.param{pi}.value"] = param.detach().clone()
                for key, value in inner.state.get(param, {}).items():
                    out[f"{prefix}.param{pi}.{key}"] = value.detach().clone() if torch.is_tensor(value) else value
    return out


def take_snapshot(run_dir, step: int, *, rank: int, ddp_modules, optimizer, scheduler, data) -> Path:
    """Components: ``parameters`` (in a mixed-precision run ``bf16_compute_copy``, next to its source
    ``fp32_main_params``), ``fp8_scaling`` when FP8 keeps state, optimizer, scheduler, rng, data."""
    params = {f"{i}.{name}": p.detach().clone()
              for i, m in enumerate(ddp_modules) for name, p in m.module.named_parameters()}
    compute_copy = precision.compute_copy_name(ddp_modules)
    chunks = [m.module for m in ddp_modules]
    rng = capture_rng()
    rng.update({f"module:{where}": s for where, s in capture_module_rng(chunks).items()})
    state = {"step": step, "rank": rank, compute_copy or "parameters": params,
             "buffers": {name: b.detach().clone() for name, b in module_buffers(chunks).items()}}
    if compute_copy:
        state["fp32_main_params"] = {n: t.detach().clone() for n, t in precision.main_params(ddp_modules)}
    fp8 = precision.fp8_scaling_state(ddp_modules)
    if fp8:
        state["fp8_scaling"] = {n: t.detach().clone() for n, t in fp8.items()}
    state.update({
        "optimizer": _optimizer_state(optimizer),
        "scheduler": dict(scheduler.state_dict()),
        "rng": rng,
        "data": data.state_dict(),
    })
    path = snapshot_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def inject_restore_faults(faults, *, ddp_modules, optimizer, scheduler_state_before: dict, scheduler, data,
                          data_state_before):
    """Undo selected parts of a restore, as a buggy resume would (test-only)."""
    for fault in faults:
        if fault not in FAULTS:
            raise ValueError(f"unknown restore fault {fault!r}; known: {', '.join(FAULTS)}")
    if "compute_copy.rounding" in faults:
        precision.fault_round_compute_copy(optimizer)
    if "fp8.amax_history" in faults:
        precision.fault_drop_fp8_scaling(ddp_modules)
    if "optimizer.exp_avg" in faults:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            for param_state in opt.optimizer.state.values():
                if "exp_avg" in param_state:
                    param_state["exp_avg"].zero_()
    if "scheduler" in faults:
        scheduler.load_state_dict(scheduler_state_before)
    if "data" in faults:
        data.load_state_dict(data_state_before)


def read_snapshot(path, *, mmap: bool = False) -> dict:
    """A live-state snapshot as saved; BitdetInputError naming the file otherwise."""
    state = load_tensors(path, "live-state snapshot", mmap=mmap)
    if not isinstance(state, dict) or type(state.get("step")) is not int or type(state.get("rank")) is not int:
        raise BitdetInputError(f"{path}: not a live-state snapshot (expected a mapping with 'step' and 'rank')")
    return state


def check_snapshots(run_dir, steps, nproc: int, how: str) -> None:
    """A reused reference must hold a readable snapshot for every resume step and rank: refused before
    any segment trains, not after. ``how``: what makes a reference with these snapshots."""
    for k in steps:
        for rank in range(nproc):
            path = snapshot_path(run_dir, k, rank)
            if not path.is_file():
                raise BitdetInputError(f"{run_dir}: no live-state snapshot for iteration {k} rank {rank} ({path}); "
                                       f"{how}")
            state = read_snapshot(path, mmap=True)  # the structure only: compare_snapshots reads the bytes
            if (state["step"], state["rank"]) != (k, rank):
                raise BitdetInputError(f"{path}: the snapshot is of step {state['step']} rank {state['rank']}")
