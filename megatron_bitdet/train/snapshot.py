"""Live-state snapshots for checkpoint-resume validation.

The reference run snapshots its in-memory state after step K; a resumed run snapshots right after
restoring K. Both come from the live objects, not from the checkpoint files, so a restore that skips
or mangles a component shows up as a difference. Contents are tensors, numbers and strings only
(loaded with ``weights_only=True``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatron_bitdet.rundir import snapshot_path
from megatron_bitdet.train.checkpoint import capture_rng
from megatron_bitdet.train.module_state import capture_module_rng, module_buffers

# Restore components a fault-injection test may skip (``--fault-skip-restore``); never set in real runs.
FAULTS = ("rng.python", "rng.numpy", "rng.torch_cpu", "rng.tracker", "rng.module", "data", "optimizer.exp_avg",
          "scheduler")


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
    chunks = [m.module for m in ddp_modules]
    rng = capture_rng()
    rng.update({f"module:{where}": s for where, s in capture_module_rng(chunks).items()})
    state = {
        "step": step,
        "rank": rank,
        "parameters": {
            f"{i}.{name}": p.detach().clone()
            for i, m in enumerate(ddp_modules) for name, p in m.module.named_parameters()
        },
        "buffers": {name: b.detach().clone() for name, b in module_buffers(chunks).items()},
        "optimizer": _optimizer_state(optimizer),
        "scheduler": dict(scheduler.state_dict()),
        "rng": rng,
        "data": data.state_dict(),
    }
    path = snapshot_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def inject_restore_faults(faults, *, optimizer, scheduler_state_before: dict, scheduler, data, data_state_before):
    """Undo selected parts of a restore, as a buggy resume would (test-only)."""
    for fault in faults:
        if fault not in FAULTS:
            raise ValueError(f"unknown restore fault {fault!r}; known: {', '.join(FAULTS)}")
    if "optimizer.exp_avg" in faults:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            for param_state in opt.optimizer.state.values():
                if "exp_avg" in param_state:
                    param_state["exp_avg"].zero_()
    if "scheduler" in faults:
        scheduler.load_state_dict(scheduler_state_before)
    if "data" in faults:
        data.load_state_dict(data_state_before)
