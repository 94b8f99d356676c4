"""Operator tracing: inputs fingerprinted BEFORE the op (in-place ops mutate them), outputs after,
plus flags the analysis needs to rule out read artifacts.

Two tracers write the same record format: the native one (``native/op_trace.cpp``, a C++ dispatcher
fallback, no Python per op) on CPU-only machines with the default ``fast`` hash, and a Python
TorchDispatchMode everywhere else (accelerators: on-device digests; other hashes; no compiler).

Uninitialized memory: outputs of aten.empty* are recorded as "uninit" (their garbage would differ
between runs without meaning anything); their addresses are remembered until something writes them,
and an op that reads one first is flagged `reads_uninit`.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import Tensor
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_bitdet.trace import native
from megatron_bitdet.trace.digest import digest, fast, flat_tensors, prefix, span_tag

# collectives are recorded by the torch.distributed wrappers at completion, not at launch
_SKIP_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "profiler"})
_UNINIT = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_INFO: dict = {}
_STRIDED = torch.strided


class _OpInfo:
    """What the dispatch mode needs to know about an op, computed once per overload."""

    __slots__ = ("name", "call", "skip", "uninit", "copy", "write_pos", "write_names", "view")

    def __init__(self, func):
        base = func._overloadpacket.__name__
        self.name = str(func)
        # a plain OpOverload's __call__ only forwards to _op (one Python frame less per op)
        self.call = func._op if type(func) is OpOverload else func
        self.skip = func.namespace in _SKIP_NAMESPACES
        self.uninit = base in _UNINIT
        self.copy = base == "copy_"
        hit = [(i, a.name) for i, a in enumerate(func._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
        self.write_pos = tuple(i for i, _ in hit)
        self.write_names = tuple(n for _, n in hit)
        rets = func._schema.returns
        # an ATen view op: every output aliases an input, nothing is written (no kernel touches data)
        self.view = func.namespace == "aten" and not hit and bool(rets) and (
            base == "_unsafe_view"  # a view whose schema does not say so (its input is a temporary)
            or all(r.alias_info is not None and not r.alias_info.is_write for r in rets))


def _info(func) -> _OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _OpInfo(func)
    return info


def _written(info: _OpInfo, args, kwargs) -> list:
    """The tensors this op writes (in-place / out=), from its schema."""
    if not info.write_pos:
        return []
    written = [args[i] for i in info.write_pos if i < len(args)]
    if kwargs:
        written += [kwargs[n] for n in info.write_names if n in kwargs]
    return flat_tensors(written, None)


def _same_span(t, in_t: list, ins: list) -> str | None:
    """A view op's output over exactly the memory span of an input hashed just before the op, both
    laid out so that ``fast`` hashes that span in memory order (contiguous or a permuted dense layout
    such as a transpose): the input's hex under the output's prefix and layout tag (those bytes are
    what hashing the output would read; no asynchronous collective is in flight when this is used)."""
    n = t.nbytes
    if not n:
        return None
    tag = span_tag(t)
    if tag is None:
        return None
    ptr = t.data_ptr()
    for src, d in zip(in_t, ins):
        if src.data_ptr() == ptr and src.nbytes == n and span_tag(src) is not None:
            return prefix(t) + tag + d[-16:]
    return None


class _OpTraceMode(TorchDispatchMode):
    """Every op outside the tracer's own work: inputs hashed before, outputs after, one record.

    The mode is popped while ``__torch_dispatch__`` runs, so the digests' own torch ops (copies of
    gapped views) are not traced and need no ``quiet``; the record is appended here directly (the
    same tuple ``Tracer.record`` appends) because this runs for every op of a traced step.
    """

    def __init__(self, tracer):
        super().__init__()
        self.tr = tracer
        mode = tracer.config.hash
        self.fast = mode == "fast"
        self.fp = fast if self.fast else functools.partial(digest, mode=mode)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        tr = self.tr
        info = _INFO.get(func) or _info(func)
        if tr.quiet or info.skip:
            return info.call(*args, **kwargs)
        in_t = flat_tensors(args, kwargs)
        fp = self.fp
        ins = [fp(t) for t in in_t]
        flags = None
        uninit = tr.uninit
        written = None
        if uninit:
            hits = [t for t in in_t if t.data_ptr() in uninit]
            if hits:
                written = _written(info, args, kwargs)
                ids = {id(t) for t in written}
                if any(id(t) not in ids for t in hits):
                    flags = ["reads_uninit"]
        if tr.inflight and any(t.data_ptr() in tr.inflight for t in in_t):
            flags = (flags or []) + ["reads_inflight"]
        cap = tr.capture
        armed = cap is not None and not cap.done and tr.next_id(info.name) == cap.event_id
        if armed:
            tr.quiet += 1
            try:
                pending = cap.before(func, args, kwargs)
            finally:
                tr.quiet -= 1
        out = info.call(*args, **kwargs)
        if armed:
            tr.quiet += 1
            try:
                cap.after(pending, out)
            finally:
                tr.quiet -= 1
        if isinstance(out, Tensor):
            out_t = [out] if out.layout is _STRIDED and not out.is_meta else []
        else:
            out_t = flat_tensors((out,), None)
        if info.uninit:
            flags = (flags or []) + ["uninit"]
            outs = [prefix(t) + "uninit" for t in out_t]
            uninit.update((t.data_ptr(), None) for t in out_t)
        else:
            if info.view and self.fast and not tr.inflight:
                outs = [_same_span(t, in_t, ins) or fp(t) for t in out_t]
            else:
                outs = [fp(t) for t in out_t]
            if uninit:
                for t in out_t:
                    uninit.pop(t.data_ptr(), None)
                if info.write_pos:
                    for t in written if written is not None else _written(info, args, kwargs):
                        uninit.pop(t.data_ptr(), None)
        if kwargs.get("non_blocking") or (info.copy and len(args) > 2 and args[2]):
            flags = (flags or []) + ["nonblocking"]
        tr.record_op(info.name, ins, outs, flags)
        return out


def implementation(config) -> str:
    """"native" where the C++ tracer applies and builds, else "python"."""
    accel = getattr(torch, "accelerator", None)
    on_accel = accel.is_available() if accel is not None else torch.cuda.is_available()
    if config.hash == "fast" and not on_accel and native.load() is not None:
        return "native"
    return "python"


def _overload(name: str) -> OpOverload:
    """"aten.add.Tensor" -> torch.ops.aten.add.Tensor"""
    ns, op, overload = name.rsplit(".", 2)
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


@contextmanager
def installed(tracer):
    if tracer.op_tracer == "native":  # bound by the tracer for the step; disarmed when it stops
        cap = tracer.capture
        if cap is not None and not cap.done:
            native.load().arm(cap.event_id, lambda name, args, kwargs: cap.before(_overload(name), args, kwargs),
                              cap.after)
        yield
        return
    with _OpTraceMode(tracer):
        try:
            yield
        finally:
            tracer.uninit.clear()
