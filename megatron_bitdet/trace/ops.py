"""Operator tracing with TorchDispatchMode: inputs fingerprinted BEFORE the op (in-place ops mutate
them), outputs after, plus flags the analysis needs to rule out read artifacts."""
from __future__ import annotations

from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode

from megatron_bitdet.trace.digest import trace_tensors

# collectives are recorded by the torch.distributed wrappers at completion, not at launch
_SKIP_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "profiler"})
_UNINIT = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


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
        out = func(*args, **kwargs)
        extra = {}
        base = func._overloadpacket.__name__
        if base in _UNINIT:
            extra["flags"] = ["uninit"]
        elif kwargs.get("non_blocking") or (base == "copy_" and len(args) > 2 and args[2]):
            extra["flags"] = ["nonblocking"]
        if tr.inflight and any(t.data_ptr() in tr.inflight for t in in_t):
            extra.setdefault("flags", []).append("reads_inflight")
        tr.record("op", str(func), ins, tr.fps(trace_tensors(out)), **extra)
        return out


@contextmanager
def installed(tracer):
    with _OpTraceMode(tracer):
        yield
