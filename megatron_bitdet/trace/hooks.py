"""Module hooks: the current scope for every record, and (level `module`) forward/backward events.

Backward scope and module-backward events use tensor hooks on module outputs (gradient arrives:
the module's backward begins) and inputs (gradient leaves: it ends). Full module backward hooks are
avoided on purpose: they wrap outputs in a BackwardHookFunction that breaks in-place ops on them.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from megatron_bitdet.trace.digest import flat_tensors


def _claim(t, attr: str, token) -> bool:
    """First hook registered on a tensor (in this traced step) owns its scope change: the innermost
    module for an output (inner forward hooks run first), the outermost for an input (outer pre-hooks
    run first)."""
    if getattr(t, attr, None) is token:
        return False
    setattr(t, attr, token)
    return True


class _ModuleHooks:
    def __init__(self, tracer, record: bool):
        self.tr = tracer
        self.record = record
        self.inputs: dict[str, list] = {}     # name -> stack of input fingerprints (re-entrant calls)
        self.grad_out: dict[str, list] = {}   # name -> grad_output fingerprints awaiting the grad_input
        self.handles = []
        self.tensor_handles = []              # tensor hooks: removed with the module hooks

    def install(self) -> None:
        for name, mod in self.tr.modules:
            self.handles.append(mod.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(mod.register_forward_hook(self._post(name), with_kwargs=True, always_call=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for h in self.tensor_handles:  # a tensor living across steps would keep calling this step's hooks
            h.remove()
        self.tensor_handles.clear()
        for name, fps in self.grad_out.items():  # modules whose inputs need no grad (the first layer)
            if fps:
                self.tr.record("module", "backward", fps, [], phase="backward", scope=name)
        self.grad_out.clear()

    def _pre(self, name):
        def hook(mod, args, kwargs):
            tr = self.tr
            parent = tr.current()[1]
            tr.push_scope(name)
            tensors = flat_tensors(args, kwargs)
            if self.record:
                self.inputs.setdefault(name, []).append(tr.fps(tensors))
            if torch.is_grad_enabled():
                for t in tensors:
                    if t.requires_grad:
                        self.tensor_handles.append(
                            t.register_hook(self._grad_in(name, parent, _claim(t, "_bitdet_in", self))))
        return hook

    def _post(self, name):
        def hook(mod, args, kwargs, output):
            tr = self.tr
            tr.pop_scope()
            tensors = flat_tensors((output,), None)
            if self.record:
                ins = self.inputs[name].pop() if self.inputs.get(name) else []
                tr.record("module", "forward", ins, tr.fps(tensors), scope=name)
            if torch.is_grad_enabled():
                for t in tensors:
                    if t.requires_grad:
                        self.tensor_handles.append(t.register_hook(self._grad_out(name, _claim(t, "_bitdet_out", self))))
        return hook

    def _grad_out(self, name, sets_scope):
        def hook(grad):
            if self.tr.active:
                if sets_scope:
                    self.tr.bwd_scope = name
                if self.record and grad is not None:
                    self.grad_out.setdefault(name, []).extend(self.tr.fps([grad]))
        return hook

    def _grad_in(self, name, parent, sets_scope):
        def hook(grad):
            if self.tr.active:
                if sets_scope:
                    self.tr.bwd_scope = parent
                if self.record and grad is not None:
                    self.tr.record("module", "backward", self.grad_out.pop(name, []), self.tr.fps([grad]),
                                   phase="backward", scope=name)
        return hook


@contextmanager
def installed(tracer, record: bool):
    h = _ModuleHooks(tracer, record)
    h.install()
    try:
        yield h
    finally:
        h.remove()
