"""torch.distributed wrappers, present only during a traced step.

Inputs are fingerprinted before the call, outputs after completion: for async ops at `wait()` of the
returned Work (wrapped). Each record names its peers (group ranks, src / dst as global ranks) so the
analysis can follow a differing input to the rank that sent it. ``compat.collectives`` swaps them in
wherever megatron bound them.
"""
from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager

import torch.distributed as dist

from megatron_bitdet.compat.collectives import swap_collectives
from megatron_bitdet.trace.digest import flat_tensors

# name -> (argument names holding inputs, argument names holding outputs)
SPECS = {
    "all_reduce": (("tensor",), ("tensor",)),
    "reduce_scatter": (("input_list",), ("output",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
    "_reduce_scatter_base": (("input",), ("output",)),
    "all_gather": (("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "_all_gather_base": (("input_tensor",), ("output_tensor",)),
    "all_to_all": (("input_tensor_list",), ("output_tensor_list",)),
    "all_to_all_single": (("input",), ("output",)),
    "broadcast": (("tensor",), ("tensor",)),
    "send": (("tensor",), ()),
    "isend": (("tensor",), ()),
    "recv": ((), ("tensor",)),
    "irecv": ((), ("tensor",)),
}
_ALWAYS_ASYNC = {"isend", "irecv"}
_local = threading.local()


def _group_ranks(group) -> list[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _global(group, rank):
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


def _peer(a: dict) -> dict:
    group = a.get("group")
    peer = {"group": _group_ranks(group)}
    for key in ("src", "dst"):
        if a.get(key) is not None:
            peer[key] = a[key]
        elif a.get(f"group_{key}") is not None:
            peer[key] = _global(group, a[f"group_{key}"])
    return peer


class TracedWork:
    """Delegates to a c10d Work; the trace record is written once, when wait() returns."""

    def __init__(self, work, on_done):
        self._work, self._on_done = work, on_done

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _run_inside(tracer, orig, args, kwargs):
    """Nested collectives and the ops they run internally are part of this record, not their own."""
    _local.inside = True
    tracer.quiet += 1
    try:
        return orig(*args, **kwargs)
    finally:
        _local.inside = False
        tracer.quiet -= 1


def _completion(tracer, name, out_tensors, peer, where, flags=()):
    """A callback recording outputs at completion; registers the buffers as in flight until then."""
    ptrs = [t.data_ptr() for t in out_tensors]
    for p in ptrs:
        tracer.in_flight(p, name)

    def done():
        for p in ptrs:
            tracer.landed(p)
        if tracer.active:
            extra = {"flags": list(flags)} if flags else {}
            tracer.record("coll", name, where[2], tracer.fps(out_tensors), phase=where[0], scope=where[1],
                          peer=peer, **extra)
    return done


@functools.lru_cache(maxsize=None)
def _binder(fn):
    """``args, kwargs -> {name: value}`` with defaults applied, as ``signature.bind`` then
    ``apply_defaults`` (a collective's wrapper runs it per call; ``bind`` is the slow part): a dict
    built from the parameter names, and ``bind`` itself for anything but plain arguments (so a wrong
    call raises its TypeError)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    names = [p.name for p in params]
    positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    required = frozenset(names) - frozenset(defaults)
    known = frozenset(names)

    def slow(args, kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def bind(args, kwargs):
        if not plain or len(args) > positional or not known.issuperset(kwargs):
            return slow(args, kwargs)
        a = dict(defaults)
        a.update(zip(names, args))
        if any(n in kwargs for n in names[:len(args)]):
            return slow(args, kwargs)
        a.update(kwargs)
        if not required.issubset(a):
            return slow(args, kwargs)
        return {n: a[n] for n in names}
    return bind


def _wrap(tracer, name, orig):
    bind = _binder(orig)
    in_names, out_names = SPECS[name]

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if getattr(_local, "inside", False) or not tracer.active:
            return orig(*args, **kwargs)
        a = bind(args, kwargs)
        phase, scope = tracer.current()
        ins = tracer.fps(flat_tensors([a[n] for n in in_names], None))
        peer = _peer(a)
        res = _run_inside(tracer, orig, args, kwargs)
        if name == "recv" and isinstance(res, int):
            peer["src"] = res
        done = _completion(tracer, name, flat_tensors([a[n] for n in out_names], None), peer, (phase, scope, ins))
        if res is not None and (a.get("async_op") or name in _ALWAYS_ASYNC):
            return TracedWork(res, done)
        done()
        return res
    return wrapper


def _wrap_batch(tracer, orig):
    """batch_isend_irecv: sends recorded at launch, receives once every returned Work has been waited."""
    @functools.wraps(orig)
    def wrapper(p2p_op_list):
        if getattr(_local, "inside", False) or not tracer.active:
            return orig(p2p_op_list)
        phase, scope = tracer.current()
        recvs = []
        for op in p2p_op_list:
            kind = getattr(op.op, "__name__", "")
            peer = {"group": _group_ranks(op.group), ("dst" if kind == "isend" else "src"): op.peer}
            if kind == "isend":
                tracer.record("coll", "batch.isend", tracer.fps([op.tensor]), [], phase=phase, scope=scope,
                              peer=peer)
            else:
                recvs.append(_completion(tracer, "batch.irecv", [op.tensor], peer, (phase, scope, [])))
        works = _run_inside(tracer, orig, (p2p_op_list,), {})
        if not works:
            for r in recvs:
                r()
            return works
        remaining = [len(works)]

        def one_done():
            remaining[0] -= 1
            if remaining[0] == 0:
                for r in recvs:
                    r()
        return [TracedWork(w, one_done) for w in works]
    return wrapper


@contextmanager
def installed(tracer):
    if not dist.is_available():
        yield
        return

    def wrap(name, fn):
        return _wrap_batch(tracer, fn) if name == "batch_isend_irecv" else _wrap(tracer, name, fn)

    with swap_collectives(wrap, (*SPECS, "batch_isend_irecv")):
        yield
