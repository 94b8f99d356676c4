"""torch.distributed wrappers, present only during a traced step.

Inputs are fingerprinted before the call, outputs after completion: for async ops at `wait()` of the
returned Work (wrapped); for a collective c10d only queues (inside ``_coalescing_manager``, as
megatron's DDP reduces gradients and gathers parameters) when the block has run it: at the block's
end, or for an async block at the coalescing manager's ``wait()``. Each record names its peers
(group ranks, src / dst as global ranks) so the analysis can follow a differing input to the rank
that sent it. ``compat.collectives`` swaps them in wherever megatron bound them.
"""
from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_bitdet.compat.collectives import swap_collectives
from megatron_bitdet.trace.digest import flat_tensors
from megatron_bitdet.trace.format import extra_json

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
_PEER_ARGS = ("group", "src", "dst", "group_src", "group_dst")


class _Local(threading.local):
    inside = False  # a wrapped collective runs on this thread: nested ones are part of its record


_local = _Local()


def _group_ranks(group) -> list[int]:
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _global(group, rank):
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


def _peer(group, src, dst, group_src, group_dst) -> dict:
    """The peers of a call, from its ``_PEER_ARGS``."""
    peer = {"group": _group_ranks(group)}
    for key, rank, group_rank in (("src", src, group_src), ("dst", dst, group_dst)):
        if rank is not None:
            peer[key] = rank
        elif group_rank is not None:
            peer[key] = _global(group, group_rank)
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
    """Nested collectives and the ops they run internally are part of this record, not their own (only
    the op level traces ops: its tracer goes quiet)."""
    _local.inside = True
    quiet = tracer.op_tracer is not None
    if quiet:
        tracer.quiet += 1
    try:
        return orig(*args, **kwargs)
    finally:
        _local.inside = False
        if quiet:
            tracer.quiet -= 1


def _completion(tracer, name, out_tensors, fields: str, where):
    """A callback recording outputs at completion; registers the buffers as in flight until then."""
    ptrs = [t.data_ptr() for t in out_tensors] if tracer.tracks_memory else ()
    for p in ptrs:
        tracer.in_flight(p, name)

    def done():
        for p in ptrs:
            tracer.landed(p)
        if tracer.active:
            tracer.record("coll", name, where[2], tracer.fps(out_tensors), phase=where[0], scope=where[1],
                          fields=fields)
    return done


@functools.lru_cache(maxsize=None)
def _binder(fn, wanted: tuple):
    """``args, kwargs -> [value, ...]`` of the parameters ``wanted``, in order (None for those ``fn`` lacks),
    defaults applied, as ``signature.bind`` then ``apply_defaults`` give them (a collective's wrapper
    runs it per call; ``bind`` is the slow part): read from the argument positions, and ``bind``
    itself for anything but plain arguments (so a wrong call raises its TypeError)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    names = [p.name for p in params]
    positional = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
    plain = all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params)
    known = frozenset(names)
    # the required parameters a call with n positional arguments must pass by keyword
    by_keyword = [tuple(p.name for p in params[n:] if p.default is p.empty) for n in range(len(params) + 1)]
    slots = tuple((w, names.index(w) if w in names[:positional] else len(names),
                   sig.parameters[w].default if w in known else None) for w in wanted)

    def slow(args, kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return [bound.arguments.get(w) for w in wanted]

    def bind(args, kwargs):
        n = len(args)
        if not plain or n > positional:
            return slow(args, kwargs)
        if kwargs and (not known.issuperset(kwargs) or any(k in kwargs for k in names[:n])):
            return slow(args, kwargs)
        for r in by_keyword[n]:
            if r not in kwargs:
                return slow(args, kwargs)
        values = []
        for w, i, default in slots:
            values.append(args[i] if i < n else kwargs.get(w, default))
        return values
    return bind


def _queue(group):
    """The op list c10d queues ``group``'s collectives in right now (inside ``_coalescing_manager``),
    or None; its identity names the coalescing block."""
    state = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    if not state:
        return None
    return state.get(group if group is not None else c10d._get_default_group())


def _wrap(tracer, name, orig, peers: dict, blocks: dict):
    """The traced ``orig``. Per call it runs in the middle of a step, its code and data evicted from the
    caches by the model's ops since the last collective: every Python call it makes costs several times
    what it costs in a loop, so the usual call (synchronous, outside a coalescing block) records inline."""
    in_names, out_names = SPECS[name]
    # at most one argument holds inputs and one outputs; "" names none (bound as None)
    bind = _binder(orig, (*(in_names or ("",)), *(out_names or ("",)), *_PEER_ARGS, "async_op"))
    always_async = name in _ALWAYS_ASYNC
    recv = name == "recv"
    local, fps, record, memory = _local, tracer.fps, tracer.record, tracer.tracks_memory

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if local.inside or not tracer.active:
            return orig(*args, **kwargs)
        x_in, x_out, group, src, dst, group_src, group_dst, async_op = bind(args, kwargs)
        phase, scope = tracer.current()
        ins = fps(flat_tensors((x_in,), None))
        queue = _queue(group) if blocks else None
        queued = len(queue) if queue is not None else 0
        res = _run_inside(tracer, orig, args, kwargs)
        key = (group, src, dst, group_src, group_dst)
        if recv and isinstance(res, int):  # the sender, known once received
            fields = extra_json({"peer": {**_peer(*key), "src": res}})
        else:
            fields = peers.get(key)
            if fields is None:  # made once per peers: the same collectives run every micro-batch
                fields = peers[key] = extra_json({"peer": _peer(*key)})
        outs = flat_tensors((x_out,), None)
        if queue is not None and len(queue) > queued and id(queue) in blocks:  # queued: runs at the block's end
            blocks[id(queue)].append(_completion(tracer, name, outs, fields, (phase, scope, ins)))
            return res
        if res is not None and (async_op or always_async):
            return TracedWork(res, _completion(tracer, name, outs, fields, (phase, scope, ins)))
        if memory:  # the outputs are written (what _completion's callback does, inline)
            for t in outs:
                tracer.landed(t.data_ptr())
        record("coll", name, ins, fps(outs), phase=phase, scope=scope, fields=fields)
        return res
    return wrapper


def _wrap_batch(tracer, orig):
    """batch_isend_irecv: sends recorded at launch, receives once every returned Work has been waited."""
    @functools.wraps(orig)
    def wrapper(p2p_op_list):
        if _local.inside or not tracer.active:
            return orig(p2p_op_list)
        phase, scope = tracer.current()
        recvs = []
        for op in p2p_op_list:
            kind = getattr(op.op, "__name__", "")
            fields = extra_json({"peer": {"group": _group_ranks(op.group),
                                          ("dst" if kind == "isend" else "src"): op.peer}})
            if kind == "isend":
                tracer.record("coll", "batch.isend", tracer.fps([op.tensor]), [], phase=phase, scope=scope,
                              fields=fields)
            else:
                recvs.append(_completion(tracer, "batch.irecv", [op.tensor], fields, (phase, scope, [])))
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


def _wrap_coalescing(tracer, orig, blocks: dict):
    """_coalescing_manager: the collectives queued in the block are recorded once they have run, at
    the block's end, or for ``async_ops`` when the manager it yields is waited on."""
    bind = _binder(orig, ("group", "async_ops"))

    @contextmanager
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if _local.inside or not tracer.active:
            with orig(*args, **kwargs) as cm:
                yield cm
            return
        group, async_ops = bind(args, kwargs)
        dones: list = []
        with orig(*args, **kwargs) as cm:
            key = id(_queue(group))
            blocks[key] = dones
            try:
                yield cm
            finally:
                blocks.pop(key, None)
        if not async_ops:
            for done in dones:
                done()
            return
        wait = cm.wait

        def waited(*args, **kwargs):
            result = wait(*args, **kwargs)
            while dones:
                dones.pop(0)()
            return result
        cm.wait = waited
    return wrapper


class Wrappers:
    """A tracer's wrappers, made at its first traced step and kept (each step swaps them in and out):
    ``(name, original) -> wrapper``, the same wrapper for the same original."""

    def __init__(self, tracer):
        self.tracer = tracer
        self.peers: dict = {}   # _PEER_ARGS' values -> the "peer" field's JSON (_wrap)
        self.blocks: dict = {}  # id(queue) -> completions, per open coalescing block (_wrap_coalescing)
        self.made: dict = {}

    def __call__(self, name, fn):
        w = self.made.get((name, fn))
        if w is None:
            if name == "batch_isend_irecv":
                w = _wrap_batch(self.tracer, fn)
            elif name == "_coalescing_manager":
                w = _wrap_coalescing(self.tracer, fn, self.blocks)
            else:
                w = _wrap(self.tracer, name, fn, self.peers, self.blocks)
            self.made[(name, fn)] = w
        return w


@contextmanager
def installed(tracer):
    if not dist.is_available():
        yield
        return
    if tracer.collective_wrappers is None:
        tracer.collective_wrappers = Wrappers(tracer)
    with swap_collectives(tracer.collective_wrappers, (*SPECS, "batch_isend_irecv", "_coalescing_manager")):
        yield
