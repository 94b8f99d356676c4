"""Workarounds for megatron-core's checkpointing (0.16.1 with torch Adam), in one place.

``prepare_optimizer_for_load`` before building the load template, ``load_optimizer_state`` instead of
``optimizer.load_state_dict``: together a restored optimizer equals an uninterrupted run's, bit for bit.
``in_process_write_results`` before a process's synchronous saves.
"""
from __future__ import annotations

import queue

import torch

from megatron_bitdet.errors import BitdetInputError

# dist_checkpointing layout of model and distributed-optimizer shards (a save/load contract)
SHARDED_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False}


def in_process_write_results() -> None:
    """A synchronous ``dist_checkpointing.save`` runs its writer in this process, yet megatron-core
    collects the writer's results through a queue served by a manager process it spawns (once per
    process, for async saves, whose writer runs elsewhere): a fresh interpreter that imports torch to
    unpickle them, ~3.5 s of CPU per rank at its first save. An in-process queue carries the same
    results. Only for processes whose saves are all synchronous (an async save's writer could not
    reach it)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _inner_optimizers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def keeps_per_param_step(inner) -> bool:
    """torch's Adam/AdamW count steps per parameter (``state[p]["step"]``); TE's and apex's FusedAdam
    (megatron's optimizer when Transformer Engine is present) count them in ``param_groups[i]["step"]``."""
    return type(inner).__module__.startswith("torch.optim")


def prepare_optimizer_for_load(optimizer) -> None:
    """A fresh optimizer has no state yet; megatron needs the tensors to exist to describe the shards.
    Its torch-Adam init_state_fn omits "step", which the distributed optimizer's state_dict reads."""
    for opt in _inner_optimizers(optimizer):
        if opt.init_state_fn is not None:
            opt.init_state_fn(opt.optimizer, opt.config)
            for param_state in opt.optimizer.state.values() if keeps_per_param_step(opt.optimizer) else ():
                param_state.setdefault("step", torch.tensor(0.0))


def load_optimizer_state(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict`` under no_grad (megatron copies into leaf params in place and
    the no_grad is missing upstream), then the Adam step fix below."""
    with torch.no_grad():
        optimizer.load_state_dict(state)
    restore_adam_steps(optimizer, state)


def _saved_steps(tree) -> set:
    """Every ``param_groups[*].step`` in a loaded (possibly chained) optimizer state dict."""
    if isinstance(tree, dict):
        found = {float(g["step"]) for g in tree.get("param_groups", []) if isinstance(g, dict) and "step" in g}
        for key, value in tree.items():
            if key != "param_groups":
                found |= _saved_steps(value)
        return found
    return set()


def restore_adam_steps(optimizer, loaded: dict) -> None:
    """megatron 0.16.1 + torch Adam restores "step" wrongly on two counts: the dp_reshardable loader
    copies the (unsaved) per-param step back over the restored one, and the restored ones share a
    single tensor that torch increments once per param. Each param gets its own copy of the saved step,
    and the serialized copy megatron leaves in each param group is dropped, so the live state equals
    an uninterrupted run's. A FusedAdam keeps its step in the group: that restored copy is its step,
    and stays (dropping it would restart Adam's bias correction on a GPU resume)."""
    steps = _saved_steps(loaded)
    if len(steps) > 1:
        raise BitdetInputError(f"checkpoint optimizer state holds inconsistent steps {sorted(steps)}")
    for opt in _inner_optimizers(optimizer):
        if not keeps_per_param_step(opt.optimizer):
            continue
        for param_state in opt.optimizer.state.values():
            if "step" in param_state and steps:
                param_state["step"] = torch.tensor(next(iter(steps)), dtype=torch.float32)
        for group in opt.optimizer.param_groups:
            group.pop("step", None)  # the serialized copy; torch Adam reads only the per-param step
