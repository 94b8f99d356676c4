"""Apply / revert declared patches (setattr on module globals or class attributes, originals remembered).

All-or-nothing: every declaration is version-checked, every target and replacement resolved and every
swap verified to reach what megatron calls (``verify``: no re-export-only, undeclared or uncalled
binding; every problem of every declaration reported at once) before the first ``setattr``. Applied patches are kept in a process-wide registry so the run
manifest can list them (:func:`applied_patches`) and :func:`revert_patches` can undo them in
reverse order.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

from megatron_bitdet.compat.patching import verify
from megatron_bitdet.compat.patching.declaration import PatchDeclaration, Swap, load_declarations, split_symbol
from megatron_bitdet.compat.versions import megatron_core_version, require_supported  # noqa: F401 (re-exported)
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
    swaps: List[Swap]  # those applying to the installed version

    def record(self) -> dict:
        return {
            "id": self.decl.id,
            "rule": self.decl.rule,
            "megatron_core": self.megatron_core,
            "supported": str(self.decl.megatron_core),
            "source": self.decl.source,
            "swaps": [{"replacement": s.replacement, "targets": list(s.targets)} for s in self.swaps],
        }


_REGISTRY: Dict[str, _Applied] = {}


def _resolve(decl: PatchDeclaration, symbol: str, *, absent_ok: bool = False):
    """(owner, attr, its own value): the module, or for ``Class.attr`` the class (``vars``, not
    inheritance: a method inherited is verify's error, not a silent patch of the subclass)."""
    module_name, attr = split_symbol(symbol)
    try:
        owner = importlib.import_module(module_name)
    except Exception as exc:  # a target module may fail for reasons other than ImportError (e.g. CUDA)
        raise BitdetError(f"{decl.source}: cannot import {module_name!r} for {symbol!r}: {exc}") from exc
    if "." in attr:
        cls_name, attr = attr.split(".")
        owner = vars(owner).get(cls_name)
        if not isinstance(owner, type):
            raise BitdetError(f"{decl.source}: {symbol!r}: {module_name} has no class {cls_name!r}; "
                              "the declaration is stale for this version")
        absent_ok = True  # an inherited or missing method: verify names where it is
    value = vars(owner).get(attr, _ABSENT)
    if value is _ABSENT and not absent_ok:
        raise BitdetError(
            f"{decl.source}: {symbol!r} does not exist in the installed megatron-core / package; "
            "the declaration is stale for this version"
        )
    return owner, attr, value


def _plan(decl: PatchDeclaration, mcore: str, index: dict) -> tuple:
    if not decl.supports(mcore):
        raise BitdetError(
            f"{decl.source}: patch {decl.id!r} supports megatron-core {decl.megatron_core}, installed is {mcore}; "
            "refusing to patch (re-check its targets for this version and widen the range)"
        )
    swaps = [s for s in decl.swaps if s.applies(mcore)]
    if not swaps:
        raise BitdetError(f"{decl.source}: no swap of patch {decl.id!r} applies to megatron-core {mcore}")
    bindings, problems = [], []
    for swap in swaps:
        replacement = _resolve(decl, swap.replacement)[2]
        if replacement is _ABSENT:
            raise BitdetError(f"{decl.source}: replacement {swap.replacement!r} does not exist")
        resolved = [(t, *_resolve(decl, t, absent_ok=swap.optional_binding)) for t in swap.targets]
        problems += [f"{decl.source}: {p}" for p in verify.problems(
            swap, [(t, owner, attr, None if v is _ABSENT else v) for t, owner, attr, v in resolved], index)]
        bindings += [_Binding(owner, attr, v, _like(v, replacement)) for _, owner, attr, v in resolved]
    return _Applied(decl, bindings, mcore, swaps), problems


def _like(original, replacement):
    """A class attribute keeps its kind: a static or class method's replacement is wrapped the same way."""
    kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
    return kind(replacement) if kind and not isinstance(replacement, kind) else replacement


def apply_patches(declarations: Iterable[PatchDeclaration]) -> List[dict]:
    """Install every declaration (refusing all if any is unsupported or stale); returns their records."""
    declarations = list(declarations)
    mcore = require_supported()
    again = [d.id for d in declarations if d.id in _REGISTRY]
    if again:
        raise BitdetError(f"patch(es) {again} are already applied; revert them first")
    for target in {t for d in declarations for s in d.swaps if s.applies(mcore) for t in s.targets}:
        with contextlib.suppress(Exception):  # the bindings their imports make are indexed; _plan reports failures
            importlib.import_module(split_symbol(target)[0])
    plans, problems, index = [], [], verify.binding_index()
    for decl in declarations:
        plan, found = _plan(decl, mcore, index)
        plans.append(plan)
        problems += found
    if problems:
        raise BitdetError(f"{len(problems)} declared swap target(s) would not reach what megatron-core "
                          f"{mcore} calls; nothing was patched:\n  " + "\n  ".join(problems))
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
