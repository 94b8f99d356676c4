"""What a training step's fingerprint line holds, taken from megatron's DDP buffers (the line's
format and writer: ``fingerprint.steps``)."""
from __future__ import annotations

from megatron_bitdet.fingerprint.tensor import state_digest


def moe_aux_losses(num_microbatches: int, *, names=None, clear: bool = True) -> dict:
    """Per-layer load-balancing losses from megatron's tracker (``names``: only these entries).
    Megatron-LM's own logging reduces and clears the tracker after the step, so under it the rank's
    own values are read without clearing (``clear=False``)."""
    import torch
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    out = {}
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        if names is not None and name not in names:
            continue
        values = entry["values"] / num_microbatches
        for layer, v in enumerate(values):
            if v != 0:
                out[f"{name}/layer_{layer + 1:02d}"] = v.to(torch.float32)
    if clear:
        clear_aux_losses_tracker()
    return out


def step_metrics(*, lm_loss, aux: dict, aux_coeff: float, grad_norm, lr, num_zeros=None) -> dict:
    """The metrics of one fingerprint line, for bitdet's loop and Megatron-LM's alike."""
    aux_total = sum(aux.values()) * aux_coeff if aux else None
    return {
        "loss": None if lm_loss is None else (lm_loss + aux_total if aux_total is not None else lm_loss),
        "lm_loss": lm_loss,
        "aux_loss": aux_total,
        **{f"aux_loss/{k}": v for k, v in aux.items()},
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "num_zeros": None if num_zeros is None else float(num_zeros),
        "lr": float(lr),
    }


def ddp_buffers(ddp_modules, attr: str) -> list:
    """megatron DDP's contiguous ``param_data`` or ``grad_data`` buffers on this rank, dense then expert."""
    return [getattr(b, attr) for m in ddp_modules for b in (*m.buffers, *m.expert_parallel_buffers)]


def buffer_digest(ddp_modules, attr: str) -> str:
    """Digest of the rank's DDP buffers: one hash over a few large tensors, negligible next to a step.
    Without the distributed optimizer megatron allocates no ``param_data`` for 16-bit params: those
    buffers are digested as their params, in buffer order."""
    buffers = [b for m in ddp_modules for b in (*m.buffers, *m.expert_parallel_buffers)]
    return state_digest(item for i, b in enumerate(buffers)
                        for item in ([(f"buf{i}", getattr(b, attr))] if getattr(b, attr) is not None
                                     else [(f"buf{i}.{j}", p.detach()) for j, p in enumerate(b.params)]))


def state_digests(model, grads_digest: str) -> dict:
    """Every digest a step's fingerprint line carries beside ``grads_digest``: params (DDP buffers),
    the model's buffers (router expert_bias, ...), its own generators' states when it holds any, and
    the precision digests (``precision.step_digests``). One function for both loops (bitdet's and
    Megatron-LM's), and what ``benchmarks/bench_fingerprint_overhead.py`` times."""
    from megatron_bitdet.train.module_state import buffers_digest, generators_digest, walk
    from megatron_bitdet.train.precision import step_digests

    chunks = [m.module for m in model]
    walked = walk(chunks)  # the modules as they are now, walked once for every digest below
    digests = {"params": buffer_digest(model, "param_data"), "grads": grads_digest,
               "buffers": buffers_digest(chunks, walked)}
    generators = generators_digest(chunks, walked)
    if generators is not None:
        digests["generators"] = generators
    digests.update(step_digests(model, walked))
    return digests
