"""A swap that cannot silently miss: before anything is patched, each target must be the binding
megatron really calls.

``from m import f`` copies ``f``; a later release may turn ``m`` into a re-export (0.18's
``ssm.mamba_block``: ``from ..hybrid_block import *``), so ``setattr(m, "f", new)`` then succeeds and
changes nothing that runs. :func:`problems` judges one swap against the megatron-core imported now:

- a module-global target must be read by code of its own module (a call site) or be the definition
  itself (``module.f`` callers, later ``from module import f``); otherwise it only re-exports;
- every imported ``megatron.core`` module that binds the same original (by identity), and the module
  that defines it, must be a target or declared ``untouched`` with a reason;
- a class-attribute target (``Class.method``) must be defined on that class (not inherited), no
  megatron subclass may override it undeclared, and some megatron code must still look the name up;
- at least one target of the swap must still be called: read as a global by its module, or (a
  definition, a method) looked up by name somewhere in megatron-core.
"""
from __future__ import annotations

import sys
import types

from megatron_bitdet.compat.rebind import megatron_modules

_TRACKED = (type, types.FunctionType)  # objects identity says something about (not flags, None, CPU stand-ins)


def code_names(obj, module_name: str | None = None, exclude=None) -> set:
    """Every name the code of ``obj`` (a function, or a class's functions and properties; with
    ``module_name``, only those defined in that module; never ``exclude``'s own body) reads as a
    global or an attribute."""
    names, seen = set(), {id(exclude)} if exclude is not None else set()

    def from_code(code):
        names.update(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                from_code(const)

    def visit(value):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                visit(accessor)
        elif isinstance(value, types.FunctionType) and module_name in (None, value.__module__):
            from_code(value.__code__)
        elif isinstance(value, type) and module_name in (None, value.__module__):
            for member in list(vars(value).values()):
                visit(member)

    visit(obj)
    return names


def module_reads(module, exclude=None) -> set:
    """Names the functions and classes defined in ``module`` read (what a call site of a global is)."""
    names: set = set()
    for value in list(vars(module).values()):
        names |= code_names(value, module.__name__, exclude)
    return names


def _called_anywhere(attr: str, exclude=None) -> bool:
    """Some code of an imported megatron.core module looks ``attr`` up (besides ``exclude`` itself)."""
    return any(attr in module_reads(module, exclude) for module in megatron_modules(fresh=True))


def _raw(value):
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _symbol_of(owner, attr: str) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}:{owner.__qualname__}.{attr}"
    return f"{owner.__name__}:{attr}"


def binding_index() -> dict:
    """id(value) -> every imported megatron.core module global bound to it (one scan, shared by the
    swaps of one apply)."""
    index: dict = {}
    for module in megatron_modules(fresh=True):
        for attr, value in list(vars(module).items()):
            if isinstance(value, _TRACKED):
                index.setdefault(id(value), []).append(f"{module.__name__}:{attr}")
    return index


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def problems(swap, resolved, index: dict | None = None) -> list[str]:
    """What makes ``swap`` miss. ``resolved``: (target symbol, owner, attr, original) per target, the
    original being the owner's own value (``None`` where an optional binding is absent); ``index``:
    :func:`binding_index`, taken now when not given."""
    index = binding_index() if index is None else index

    def holders(original):
        return sorted(index.get(id(original), ()))

    declared = set(swap.targets) | set(swap.untouched)
    resolved = [r for r in resolved if not (r[3] is None and swap.optional_binding and not isinstance(r[1], type))]
    out, called, looked_up = [], False, []  # looked_up: (name, own body) megatron may call by name
    for target, owner, attr, original in resolved:
        if isinstance(owner, type):
            out += _method_problems(target, owner, attr, original, declared, holders)
            looked_up.append((attr, _raw(original)))
            continue
        tracked = isinstance(original, _TRACKED)
        if attr in module_reads(owner):
            called = True
        elif getattr(original, "__module__", None) == owner.__name__ and getattr(original, "__qualname__", None) == attr:
            looked_up.append((attr, None))  # the definition: `module.attr` callers, later imports
        else:
            readers = [h for h in holders(original) if h != target and
                       h.split(":")[1] in module_reads(sys.modules[h.split(":")[0]])] if tracked else []
            out.append(f"{target} is only a re-export: no code in {owner.__name__} reads {attr!r}"
                       + (f" (megatron calls it through {', '.join(readers)})" if readers else ""))
        if tracked:
            home = f"{original.__module__}:{original.__qualname__}"
            for holder in holders(original) + ([home] if home.startswith("megatron.core.") else []):
                if holder not in declared:
                    out.append(f"{holder} also binds the original of {target}: declare it as a target "
                               "or as untouched (with a reason)")
    if not (out or called or any(_called_anywhere(name, body) for name, body in looked_up)) and resolved:
        out.append(f"nothing in megatron-core calls {', '.join(t for t, *_ in resolved)} any more")
    return sorted(set(out))


def _method_problems(target, owner, attr, original, declared, holders) -> list[str]:
    out = []
    if original is None:
        where = next((c for c in owner.__mro__[1:] if attr in vars(c)), None)
        return [f"{target} is not defined on {owner.__qualname__}"
                + (f": it is inherited from {_symbol_of(where, attr)}; target that" if where else "")]
    for sub in _subclasses(owner):
        symbol = _symbol_of(sub, attr)
        if attr in vars(sub) and symbol not in declared and sub.__module__.startswith("megatron.core"):
            out.append(f"{symbol} overrides {target}: its instances would not reach the replacement; "
                       "declare it as a target or as untouched (with a reason)")
    for holder in holders(_raw(original)):
        if holder not in declared:
            out.append(f"{holder} also binds the original of {target}: declare it as a target "
                       "or as untouched (with a reason)")
    return out
