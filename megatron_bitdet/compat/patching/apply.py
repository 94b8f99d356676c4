"""Apply / revert declared patches (setattr on module globals, originals remembered).

All-or-nothing: every declaration is version-checked and every target and replacement resolved
before the first ``setattr``. Applied patches are kept in a process-wide registry so the run
manifest can list them (:func:`applied_patches`) and :func:`revert_patches` can undo them in
reverse order.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

from megatron_bitdet.compat.patching.declaration import PatchDeclaration, load_declarations, split_symbol
from megatron_bitdet.compat.versions import megatron_core_version
from megatron_bitdet.errors import BitdetError

_ABSENT = object()  # the target module had no such global before the patch


@dataclass
class _Binding:
    module: object
    attr: str
    original: object
    replacement: object


@dataclass
class _Applied:
    decl: PatchDeclaration
    bindings: List[_Binding]
    megatron_core: str

    def record(self) -> dict:
        return {
            "id": self.decl.id,
            "rule": self.decl.rule,
            "megatron_core": self.megatron_core,
            "supported": str(self.decl.megatron_core),
            "source": self.decl.source,
            "swaps": [{"replacement": s.replacement, "targets": list(s.targets)} for s in self.decl.swaps],
        }


_REGISTRY: Dict[str, _Applied] = {}


def _resolve(decl: PatchDeclaration, symbol: str, *, absent_ok: bool = False):
    module_name, attr = split_symbol(symbol)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a target module may fail for reasons other than ImportError (e.g. CUDA)
        raise BitdetError(f"{decl.source}: cannot import {module_name!r} for {symbol!r}: {exc}") from exc
    value = module.__dict__.get(attr, _ABSENT)
    if value is _ABSENT and not absent_ok:
        raise BitdetError(
            f"{decl.source}: {symbol!r} does not exist in the installed megatron-core / package; "
            "the declaration is stale for this version"
        )
    return module, attr, value


def _plan(decl: PatchDeclaration, mcore: str) -> _Applied:
    if not decl.supports(mcore):
        raise BitdetError(
            f"{decl.source}: patch {decl.id!r} supports megatron-core {decl.megatron_core}, installed is {mcore}; "
            "refusing to patch (re-check its targets for this version and widen the range)"
        )
    bindings = []
    for swap in decl.swaps:
        _, _, replacement = _resolve(decl, swap.replacement)
        for target in swap.targets:
            module, attr, original = _resolve(decl, target, absent_ok=swap.optional_binding)
            bindings.append(_Binding(module, attr, original, replacement))
    return _Applied(decl, bindings, mcore)


def apply_patches(declarations: Iterable[PatchDeclaration]) -> List[dict]:
    """Install every declaration (refusing all if any is unsupported or stale); returns their records."""
    declarations = list(declarations)
    mcore = megatron_core_version()
    again = [d.id for d in declarations if d.id in _REGISTRY]
    if again:
        raise BitdetError(f"patch(es) {again} are already applied; revert them first")
    plans = [_plan(d, mcore) for d in declarations]
    for plan in plans:
        for b in plan.bindings:
            setattr(b.module, b.attr, b.replacement)
        _REGISTRY[plan.decl.id] = plan
    return [p.record() for p in plans]


def revert_patches(ids: Optional[Sequence[str]] = None) -> List[str]:
    """Restore the originals of ``ids`` (default: all applied), newest first; returns the ids reverted."""
    ids = list(_REGISTRY) if ids is None else list(ids)
    unknown = [i for i in ids if i not in _REGISTRY]
    if unknown:
        raise BitdetError(f"patch(es) {unknown} are not applied")
    for pid in reversed(ids):
        for b in reversed(_REGISTRY.pop(pid).bindings):
            if b.original is _ABSENT:
                delattr(b.module, b.attr)
            else:
                setattr(b.module, b.attr, b.original)
    return ids


def applied_patches() -> List[dict]:
    """Records of the patches applied in this process, in application order (for the manifest)."""
    return [a.record() for a in _REGISTRY.values()]


@contextlib.contextmanager
def patched(declarations: Optional[Iterable[PatchDeclaration]] = None):
    """``with patched(): ...`` applies the given declarations (default: all in ``patches/``) and
    reverts exactly those on exit; yields their records."""
    declarations = load_declarations() if declarations is None else list(declarations)
    records = apply_patches(declarations)
    try:
        yield records
    finally:
        revert_patches([r["id"] for r in records])
