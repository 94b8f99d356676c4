"""Module hooks: the current scope for every record, and (level `module`) forward/backward events.

Backward scope and module-backward events use tensor hooks on module outputs (gradient arrives:
the module's backward begins) and inputs (gradient leaves: it ends). Full module backward hooks are
avoided on purpose: they wrap outputs in a BackwardHookFunction that breaks in-place ops on them.

A tensor is usually several modules' output and the next ones' input; its entries (one per module
that hooked it) share one tensor hook, in the order they were added, as long as no other hook was
added to the tensor in between and it was not modified in place (see ``_attach``).

A module with no hook of its own (while no global module hook exists) gets the forward hooks as a
wrapper of its ``forward`` instead (``_wrap_forward``): the same records, without nn.Module's slow
call path. A direct ``m.forward(...)`` call (megatron makes a few, e.g. megatron-FSDP on the model it
wraps) is then recorded too, where registered hooks never see it; both tracers do the same.

Where the native tracer runs the step, the hooks are its C++ functions (``op_trace.cpp``: the same
logic, records and scopes kept in C++); these Python hooks run everywhere else, with the same records.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch.utils.hooks import RemovableHandle

from megatron_bitdet.trace.digest import flat_tensors, trace_tensors
from megatron_bitdet.trace.format import json_str

_TENSOR = torch.Tensor
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_always_called")
# torch keeps a module's hooks in these dicts (every release since 2.1); where it does not, the public API
_DIRECT = hasattr(RemovableHandle, "next_id") and all(isinstance(getattr(torch.nn.Module(), d, None), dict)
                                                         for d in _HOOK_DICTS)


_M = torch.nn.modules.module  # its global hook dicts
_SHADOWS_NOTHING = object()


class _Forward:
    """What ``_wrap_forward`` set (``wrapper``) and the instance ``forward`` it shadows, to put back."""

    __slots__ = ("wrapper", "shadowed")

    def __init__(self, wrapper, shadowed):
        self.wrapper, self.shadowed = wrapper, shadowed


def _fast_path(mod) -> bool:
    """Whether nn.Module would call ``mod.forward`` at once (its fast path: no hook of the module's
    own, none global, not compiled)."""
    return not (mod._backward_hooks or mod._backward_pre_hooks or mod._forward_hooks or mod._forward_pre_hooks
                or _M._global_backward_pre_hooks or _M._global_backward_hooks or _M._global_forward_hooks
                or _M._global_forward_pre_hooks or getattr(mod, "_compiled_call_impl", None) is not None)


def _wrap_forward(mod, pre, post, native=None) -> _Forward:
    """``pre`` and ``post`` around ``mod.forward``, as an instance attribute: nn.Module keeps its fast
    path, where registered hooks would send every call through its slow one (a closure, a set and the
    hook loops per call: most of what module hooks cost in a step). Only for a module on the fast path:
    they then run where the hooks would, after any pre-hook and before any forward hook (there are
    none), ``post`` also when forward raises (``always_call``). ``native``: a function of the shadowed
    forward making the same wrapper in C++ (the native tracer's, module index bound), used instead."""
    shadowed = mod.__dict__.get("forward", _SHADOWS_NOTHING)
    orig = mod.forward
    if native is not None:
        forward = native(orig)
    else:
        def forward(*args, **kwargs):
            pre(mod, args, kwargs)
            out = None
            try:
                out = orig(*args, **kwargs)
            finally:
                post(mod, args, out)
            return out
    mod.__dict__["forward"] = forward
    return _Forward(forward, shadowed)


def _add_hooks(mod, pre, post, native=None):
    """``pre`` as ``register_forward_pre_hook(pre, with_kwargs=True)`` and ``post`` as
    ``register_forward_hook(post, always_call=True)``, returning what ``_remove_hooks`` takes: on a
    module on nn.Module's fast path a forward wrapper (``_wrap_forward``, ``native`` passed on); else
    the same dict entries under ids from the same counter, without the two RemovableHandles (which
    made up most of installing every module's hooks for each traced step)."""
    if _fast_path(mod):
        return _wrap_forward(mod, pre, post, native)
    if not _DIRECT:
        return (mod.register_forward_pre_hook(pre, with_kwargs=True), mod.register_forward_hook(post, always_call=True))
    i = RemovableHandle.next_id
    RemovableHandle.next_id = i + 2
    mod._forward_pre_hooks[i] = pre
    mod._forward_pre_hooks_with_kwargs[i] = True
    mod._forward_hooks[i + 1] = post
    mod._forward_hooks_always_called[i + 1] = True
    return i


def _remove_hooks(mod, added) -> None:
    if type(added) is _Forward:
        if mod.__dict__.get("forward") is added.wrapper:  # not replaced again meanwhile
            if added.shadowed is _SHADOWS_NOTHING:
                del mod.__dict__["forward"]
            else:
                mod.__dict__["forward"] = added.shadowed
        return
    if not _DIRECT:
        for h in added:
            h.remove()
        return
    mod._forward_pre_hooks.pop(added, None)
    mod._forward_pre_hooks_with_kwargs.pop(added, None)
    mod._forward_hooks.pop(added + 1, None)
    mod._forward_hooks_always_called.pop(added + 1, None)


class _GradHook:
    """The entries run, in order, by one tensor hook on one tensor in one traced step.

    ``(True, name, None, moves)``: the gradient reached module ``name``'s output; ``(False, name,
    parent, moves)``: it left through ``name``'s input, back to ``parent``. ``moves``: whether it sets
    the backward scope; only the first "out" entry of a tensor (the innermost module: inner forward
    hooks run first) and its first "in" entry (the outermost: outer pre-hooks run first) do.
    """

    __slots__ = ("owner", "entries", "handle_id", "version", "out_claimed", "in_claimed")

    def __init__(self, owner):
        self.owner = owner
        self.entries = None
        self.handle_id = None
        self.version = -1
        self.out_claimed = self.in_claimed = False


def _attach(tensors, owner, out: bool, name: str, parent) -> None:
    """Add an entry for each tensor's gradient, to the tensor hook this step put on it last when
    running it there is what a hook of its own would do: ours is still the last of the tensor's
    Python hooks (they run in registration order, each receiving the gradient the previous one left;
    ours return None) and the tensor is unmodified in place (a hook added after an in-place op
    belongs to the new value's node, which autograd runs at another time). Otherwise the entry gets
    a new tensor hook. Without records (level op) only the entries that move the scope are kept."""
    record = owner.record
    for t in tensors:
        g = getattr(t, "_bitdet_grad", None)
        if g is None or g.owner is not owner:  # a tensor living across steps carries an older step's
            g = t._bitdet_grad = _GradHook(owner)
        if out:
            moves = not g.out_claimed
            g.out_claimed = True
        else:
            moves = not g.in_claimed
            g.in_claimed = True
        if not (moves or record):
            continue
        entry = (out, name, parent, moves)
        if g.entries is not None and t._version == g.version and type(t) is _TENSOR:
            hooks = t._backward_hooks
            if hooks and next(reversed(hooks)) == g.handle_id:
                g.entries.append(entry)
                continue
        entries = [entry]
        handle = t.register_hook(lambda grad, entries=entries: owner._grad(entries, grad))
        owner.tensor_handles.append(handle)
        g.entries, g.handle_id, g.version = entries, handle.id, t._version


class _ModuleHooks:
    def __init__(self, tracer, record: bool):
        self.tr = tracer
        self.record = record
        self.grad_out: dict[str, list] = {}   # name -> grad_output fingerprints awaiting the grad_input
        self.handles = []
        self.tensor_handles = []              # tensor hooks: removed with the module hooks

    def install(self) -> None:
        for name, mod in self.tr.modules:
            inputs = []  # this module's input fingerprints, a stack for re-entrant calls
            self.handles.append((mod, _add_hooks(mod, self._pre(name, inputs), self._post(name, inputs))))

    def remove(self) -> None:
        for mod, added in self.handles:
            _remove_hooks(mod, added)
        for h in self.tensor_handles:  # a tensor living across steps would keep calling this step's hooks
            h.remove()
        self.tensor_handles.clear()
        for name, fps in self.grad_out.items():  # modules whose inputs need no grad (the first layer)
            if fps:
                self.tr.record("module", "backward", fps, [], phase="backward", scope=name)
        self.grad_out.clear()

    def _pre(self, name, inputs):
        def hook(mod, args, kwargs):
            tr = self.tr
            tensors = flat_tensors(args, kwargs)
            grads = [t for t in tensors if t.requires_grad] if torch.is_grad_enabled() else ()
            parent = tr.current()[1] if grads else None
            tr.push_scope(name)
            if self.record:
                inputs.append(tr.fps(tensors))
            if grads:
                _attach(grads, self, False, name, parent)
        return hook

    def _post(self, name, inputs):
        def hook(mod, args, output):
            tr = self.tr
            tr.pop_scope()
            tensors = flat_tensors((output,), None)
            if self.record:
                tr.record("module", "forward", inputs.pop() if inputs else [], tr.fps(tensors), scope=name)
            if tensors and torch.is_grad_enabled():
                _attach([t for t in tensors if t.requires_grad], self, True, name, None)
        return hook

    def _grad(self, entries, grad) -> None:
        """A tensor's gradient: its entries in order. The gradient is digested once for all of them:
        they receive the same tensor and nothing runs between them."""
        tr = self.tr
        if not tr.active:
            return
        fp = tr.fps([grad])[0] if self.record and grad is not None else None
        for out, name, parent, sets_scope in entries:
            if out:
                if sets_scope:
                    tr.bwd_scope = name
                if fp is not None:
                    self.grad_out.setdefault(name, []).append(fp)
            else:
                if sets_scope:
                    tr.bwd_scope = parent
                if fp is not None:
                    tr.record("module", "backward", self.grad_out.pop(name, []), [fp], phase="backward", scope=name)


_NATIVE_HOOKS: list = []  # (pre, post, forward wrapper maker) of module index i: they depend only on i
_NATIVE_NAMES: list = [None]  # the module names the native tracer holds (it keeps them across steps)


class _NativeModuleHooks:
    """The native tracer's hooks on every module; the step's state is the native tracer's."""

    def __init__(self, tracer, record: bool):
        self.tr = tracer
        self.record = record
        self.handles = []

    def install(self) -> None:
        tr, mod = self.tr, self.tr._native
        names = [name for name, _ in tr.modules]
        if names == _NATIVE_NAMES[0]:
            mod.hooks_begin(None, None, self.record, trace_tensors, torch.utils._pytree.SUPPORTED_NODES, torch.Tensor)
        else:
            mod.hooks_begin(names, [json_str(n) for n in names], self.record, trace_tensors,
                            torch.utils._pytree.SUPPORTED_NODES, torch.Tensor)
            _NATIVE_NAMES[0] = names
        _NATIVE_HOOKS.extend((mod.pre_hook(i), mod.post_hook(i), partial(mod.forward_wrapper, i))
                             for i in range(len(_NATIVE_HOOKS), len(names)))
        self.handles = [(m, _add_hooks(m, *h)) for (_, m), h in zip(tr.modules, _NATIVE_HOOKS)]

    def remove(self) -> None:
        for mod, added in self.handles:
            _remove_hooks(mod, added)
        self.tr._native.hooks_end()


@contextmanager
def installed(tracer, record: bool):
    h = (_NativeModuleHooks if tracer._native is not None else _ModuleHooks)(tracer, record)
    h.install()
    try:
        yield h
    finally:
        h.remove()
