"""Operator tracing with TorchDispatchMode: inputs fingerprinted BEFORE the op (in-place ops mutate
them), outputs after, plus flags the analysis needs to rule out read artifacts.

Uninitialized memory: outputs of aten.empty* are recorded as "uninit" (their garbage would differ
between runs without meaning anything); their addresses are remembered until something writes them,
and an op that reads one first is flagged `reads_uninit`.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode

from megatron_bitdet.trace.digest import prefix, trace_tensors

# collectives are recorded by the torch.distributed wrappers at completion, not at launch
_SKIP_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "profiler"})
_UNINIT = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_WRITES: dict = {}


def _written(func) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions and names of the arguments this op writes (in-place / out=), from its schema."""
    w = _WRITES.get(func)
    if w is None:
        args = func._schema.arguments
        hit = [(i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
        w = _WRITES[func] = (tuple(i for i, _ in hit), tuple(n for _, n in hit))
    return w


def _split_written(func, args, kwargs):
    pos, names = _written(func)
    written = [args[i] for i in pos if i < len(args)] + [kwargs[n] for n in names if n in kwargs]
    return trace_tensors(written)


class _OpTraceMode(TorchDispatchMode):
    def __init__(self, tracer):
        super().__init__()
        self.tr = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tr = self.tr
        if tr.quiet or func.namespace in _SKIP_NAMESPACES:
            return func(*args, **kwargs)
        in_t = trace_tensors((args, kwargs))
        ins = tr.fps(in_t)
        flags = []
        if tr.uninit:
            written = {id(t) for t in _split_written(func, args, kwargs)}
            if any(id(t) not in written and t.data_ptr() in tr.uninit for t in in_t):
                flags.append("reads_uninit")
        if tr.inflight and any(t.data_ptr() in tr.inflight for t in in_t):
            flags.append("reads_inflight")
        cap = tr.capture
        armed = cap is not None and not cap.done and tr.next_id(str(func)) == cap.event_id
        if armed:
            tr.quiet += 1
            try:
                pending = cap.before(func, args, kwargs)
            finally:
                tr.quiet -= 1
        out = func(*args, **kwargs)
        if armed:
            tr.quiet += 1
            try:
                cap.after(pending, out)
            finally:
                tr.quiet -= 1
        out_t = trace_tensors(out)
        base = func._overloadpacket.__name__
        if base in _UNINIT:
            flags.append("uninit")
            outs = [prefix(t) + "uninit" for t in out_t]
            tr.uninit.update((t.data_ptr(), None) for t in out_t)
        else:
            outs = tr.fps(out_t)
            if tr.uninit:
                for t in [*out_t, *_split_written(func, args, kwargs)]:
                    tr.uninit.pop(t.data_ptr(), None)
        if kwargs.get("non_blocking") or (base == "copy_" and len(args) > 2 and args[2]):
            flags.append("nonblocking")
        extra = {"flags": flags} if flags else {}
        tr.record("op", str(func), ins, outs, **extra)
        return out


@contextmanager
def installed(tracer):
    with _OpTraceMode(tracer):
        try:
            yield
        finally:
            tracer.uninit.clear()
