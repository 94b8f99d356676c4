"""Rebinding megatron-core's import-time copies of a function: the one place that scans sys.modules.

``from m import f`` copies ``f`` into the importing module, so replacing ``m.f`` alone misses every
such caller. ``rebind`` points every global of the given modules (default: each imported
``megatron.core`` module) that *is* an original at its replacement, and returns what it changed so
``restore`` can undo it.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager


def megatron_modules() -> list:
    """Every imported ``megatron.core`` module."""
    return [m for n, m in list(sys.modules.items()) if n.startswith("megatron.core") and m is not None]


def rebind(replacements: dict, modules=None) -> list[tuple]:
    """``replacements``: original -> replacement, matched by identity. Returns (module, attr, original)."""
    by_id = {id(old): new for old, new in replacements.items()}
    changed = []
    for module in megatron_modules() if modules is None else modules:
        for attr, value in list(vars(module).items()):
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
