"""Rebinding megatron-core's import-time copies of a function: the one place that scans sys.modules.

``from m import f`` copies ``f`` into the importing module, so replacing ``m.f`` alone misses every
such caller. ``rebind`` points every global of the given modules (default: each imported
``megatron.core`` module) that *is* an original at its replacement, and returns what it changed so
``restore`` can undo it.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager


_MODULES: list = [-1, []]  # (len(sys.modules) when last scanned, the megatron.core modules then)


def megatron_modules(fresh: bool = False) -> list:
    """Every imported ``megatron.core`` module. The tracer asks once per traced step, in the middle of
    training: the scan of sys.modules is redone only when its length changed (an import adds a key).
    Comparing its keys instead cost ~0.3 ms a step there (every key touched, in cold memory); a module
    replaced in place, or one imported while another is removed, is found at the next change, or now
    with ``fresh`` (what a patch's verification asks)."""
    n = len(sys.modules)
    if fresh or n != _MODULES[0]:
        _MODULES[:] = n, [m for k, m in list(sys.modules.items()) if k.startswith("megatron.core") and m is not None]
    return list(_MODULES[1])


_SITES: dict = {}


def _sites(by_id: dict, modules: list) -> list[tuple]:
    """(module, attr) of every global of ``modules`` bound to an original in ``by_id``. Scanning every
    megatron module's globals costs milliseconds (the tracer swaps per traced step), so the sites are
    kept for the same modules and originals: a copy is made at import, when the module list changes."""
    key = (tuple(map(id, modules)), frozenset(by_id))
    sites = _SITES.get(key)
    if sites is None:
        sites = [(m, attr) for m in modules for attr, value in list(vars(m).items()) if id(value) in by_id]
        if len(_SITES) > 16:
            _SITES.clear()
        _SITES[key] = sites
    return sites


def rebind(replacements: dict, modules=None) -> list[tuple]:
    """``replacements``: original -> replacement, matched by identity. Returns (module, attr, original)."""
    by_id = {id(old): new for old, new in replacements.items()}
    changed = []
    for module, attr in _sites(by_id, megatron_modules() if modules is None else list(modules)):
        value = vars(module).get(attr)
        new = by_id.get(id(value))
        if new is not None and new is not value:
            setattr(module, attr, new)
            changed.append((module, attr, value))
    return changed


def restore(changed: list[tuple]) -> None:
    for module, attr, original in reversed(changed):
        setattr(module, attr, original)


@contextmanager
def rebound(replacements: dict, modules=None):
    """``rebind`` for the duration of a block."""
    changed = rebind(replacements, modules)
    try:
        yield changed
    finally:
        restore(changed)
