"""A traced training step, the same in bitdet's loop (``train.loop``) and in Megatron-LM's
(``megatron_lm.loop_hooks``): the Tracer over the unwrapped model chunks (scopes are megatron's module
paths), phases forward / backward inside the forward-backward schedule, ``grad_reduce`` around
megatron's ``finalize_model_grads``, ``optimizer`` around ``optimizer.step()``, and the loop's own
bookkeeping (fingerprint hashing) kept out of the trace."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from megatron_bitdet.train.step_fingerprints import ddp_buffers


def make_tracer(trace, run_dir, rank: int, world_size: int, ddp_modules, manifest_digest: str | None):
    """This rank's Tracer for ``trace`` (a TraceConfig; None: tracing off, nothing made)."""
    if trace is None:
        return None
    from megatron_bitdet.trace import Tracer

    tracer = Tracer(run_dir, rank, world_size, level=trace.level, steps=trace.steps, ranks=trace.ranks,
                    hash=trace.hash, manifest_digest=manifest_digest, capture=trace.capture)
    tracer.attach([m.module for m in ddp_modules])
    return tracer


@contextmanager
def traced_step(tracer, config, ddp_modules, step: int):
    """Trace step ``step`` when it lies in the window (yields the tracer, else None): the DDP gradient
    buffers are recorded right after megatron's ``finalize_model_grads`` (``config``'s, swapped only
    for the step) in phase ``grad_reduce``."""
    if tracer is None or not tracer.in_window(step):
        yield None
        return
    finalize = config.finalize_model_grads_func

    def traced_finalize(*args, **kwargs):
        with tracer.phase("grad_reduce"):
            result = finalize(*args, **kwargs)
            tracer.event("grad_buffers", ddp_buffers(ddp_modules, "grad_data"), scope="ddp")
        return result

    config.finalize_model_grads_func = traced_finalize
    try:
        with tracer.step(step):
            _scratch_is_uninit(tracer)
            yield tracer
    finally:
        config.finalize_model_grads_func = finalize


def _scratch_is_uninit(tracer) -> None:
    """megatron's global memory buffer is scratch (e.g. the beta=0 operand of attention's baddbmm):
    its contents at a step's start mean nothing, like an aten.empty output's (op-level tracking)."""
    from megatron_bitdet.compat.buffers import scratch_buffers

    for t in scratch_buffers():
        tracer.mark_uninit(t.data_ptr())


@contextmanager
def untraced(tracer):
    """Bookkeeping (fingerprint hashing) inside a traced step is not part of the trace."""
    if tracer is not None:
        tracer.quiet += 1
    try:
        yield
    finally:
        if tracer is not None:
            tracer.quiet -= 1


def optimizer_state(optimizer) -> list:
    """Every tensor of the inner torch optimizers' state, in parameter-group order."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state.get(p, {})
                out += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor)]
    return out


def traced_optimizer_step(tracer, optimizer, ddp_modules, step=None):
    """``step()`` (default ``optimizer.step``), recorded under a tracer as one event in phase
    ``optimizer``: params + grads before, params + optimizer state after."""
    step = optimizer.step if step is None else step
    if tracer is None:
        return step()
    with tracer.phase("optimizer"):
        before = tracer.fps([*ddp_buffers(ddp_modules, "param_data"), *ddp_buffers(ddp_modules, "grad_data")])
        result = step()
        after = tracer.fps([*ddp_buffers(ddp_modules, "param_data"), *optimizer_state(optimizer)])
        tracer.record("event", "optimizer.step", before, after, scope="optimizer")
    return result
