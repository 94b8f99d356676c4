"""Kernel check: call a function (or module) N times with identical inputs and RNG state, under one
or several thread counts, and compare outputs and every input / parameter gradient byte for byte."""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

from megatron_bitdet.testing.core import CheckReport, NondeterminismError, RngState, compare, elements, run_once

THREADS_CAUSE = ("an accumulation whose order follows thread scheduling (atomic-style adds, index_put_ / "
                 "scatter_add_ with repeated indices, a parallel reduction split by thread count)")
THREADS_FIX = ("give each thread a private slot and combine the slots in a fixed order, or use an op torch makes "
               "deterministic under torch.use_deterministic_algorithms(True)")
OTHER_CAUSE = ("something besides the inputs, RNG state and cotangents (all identical): os.urandom / "
               "random.SystemRandom, the clock, Python hash or set order, uninitialized memory (torch.empty read "
               "before written), or an unsynchronized stream")
HINT_BACKWARD = "the outputs are repeatable, only gradients differ: look at the backward (autograd.Function / custom op)."
HINT_FLAGS_OFF = ("torch's deterministic algorithms were off (deterministic_algorithms=False); with them on, "
                  "torch picks deterministic kernels where it has them.")


@contextlib.contextmanager
def _torch_settings(threads: Optional[int], deterministic: Optional[bool]):
    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        if deterministic is not None:
            torch.use_deterministic_algorithms(deterministic)
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def check_kernel(fn, *args, repeats: int = 5, threads: Optional[Iterable[int]] = None, backward: bool = True,
                 deterministic_algorithms: Optional[bool] = True, name: Optional[str] = None, **kwargs) -> CheckReport:
    """Run ``fn(*args, **kwargs)`` ``repeats`` times per thread count (``threads``, default: the current
    count) on fresh copies of the inputs with every RNG restored, backward with fixed cotangents
    (floating inputs that require grad get gradients; a module's parameters too), and raise
    :class:`NondeterminismError` naming the first differing element if any repeat differs from the
    first. Thread counts are not compared with each other (on CPU they may legitimately change bits).
    ``deterministic_algorithms``: torch's flag during the check (True, as under --deterministic-mode;
    None leaves it as it is). Inputs on a GPU are checked there."""
    __tracebackhide__ = True  # pytest shows the message, not these frames
    if repeats < 2:
        raise ValueError("repeats must be >= 2: one run proves nothing")
    subject = f"check_kernel({name or _name(fn)})"
    counts = [torch.get_num_threads()] if threads is None else list(threads)
    failures, report = [], CheckReport(subject, repeats, [])
    for count in counts:
        setting = f"threads={count}"
        with _torch_settings(count, deterministic_algorithms):
            rng = RngState()
            runs = []
            for _ in range(repeats):
                rng.restore()
                try:
                    runs.append(run_once(fn, args, kwargs, backward=backward))
                except RuntimeError as exc:
                    if deterministic_algorithms and "deterministic" in str(exc):
                        exc.add_note(f"{subject}: torch has no deterministic implementation of an op used here; "
                                     "swap the op, or pass deterministic_algorithms=False to check it anyway")
                    raise
            rng.restore()
        report.settings.append(setting)
        report.tensors, report.elements = list(runs[0]), elements(runs[0])
        for k, run in enumerate(runs[1:], start=1):
            diffs = compare(runs[0], run)
            if diffs:
                failures.append((setting, count, k, diffs))
                break
    if failures:
        raise NondeterminismError(_message(subject, repeats, counts, failures, deterministic_algorithms),
                                  [d for f in failures for d in f[3]])
    return report


def _message(subject, repeats, counts, failures, deterministic) -> str:
    lines = [f"{subject} is not bitwise repeatable:"]
    for setting, _, k, diffs in failures:
        lines.append(f"  {setting}: repeat {k} of {repeats} differs from repeat 0 in {len(diffs)} tensor(s):")
        lines += [f"    {d}" for d in diffs[:8]]
        if len(diffs) > 8:
            lines.append(f"    ... {len(diffs) - 8} more")
    failed = {c for _, c, _, _ in failures}
    if 1 in counts and 1 not in failed:
        lines.append(f"  why: repeatable on 1 thread, not on {sorted(failed)}: {THREADS_CAUSE}; fix: {THREADS_FIX}.")
    elif 1 in failed:
        lines.append(f"  why: it differs on a single thread, so the result depends on {OTHER_CAUSE}.")
    else:
        lines.append(f"  why: either {THREADS_CAUSE}, or {OTHER_CAUSE}; add threads=(1, {max(failed)}) to tell "
                     "them apart (repeatable on 1 thread means the former).")
    if all(not d.name.startswith("output") for _, _, _, diffs in failures for d in diffs):
        lines.append("  " + HINT_BACKWARD)
    if deterministic is False:
        lines.append("  note: " + HINT_FLAGS_OFF)
    return "\n".join(lines)
