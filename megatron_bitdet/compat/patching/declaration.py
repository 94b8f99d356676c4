"""Patch declarations: each swap of a megatron-core symbol is data in ``patches/<id>.yaml``.

A declaration names every *binding* a swap must reach: ``from m import f`` copies ``f`` into the
importing module, so patching ``m.f`` alone misses that caller (``verify`` refuses, at apply time, a
declaration that misses one, or whose target only re-exports or is no longer called). A target is a
module global (``pkg.mod:name``) or a class attribute (``pkg.mod:Class.method``: every instance's
lookup reaches it). Schema (all keys required unless
marked optional; unknown keys are errors)::

    id: moe_aux_loss                      # = file stem
    rule: moe_aux_loss                    # the enforce rules-table swap id it serves
    megatron_core: ">=0.16.1,<0.17"       # optional: narrows bitdet's supported versions (compat.versions)
    why: ...                              # the nondeterminism it removes
    needed_when:                          # optional: recipes that get it whatever the rules decided,
      - {spec: local, layers: M}          #   when any entry holds (an entry: all of its keys); keys:
                                          #   spec (local|te), layers (pattern symbols, any),
                                          #   deterministic (determinism.mode), expert_impl,
                                          #   fp8 (model.fp8.recipe is not none),
                                          #   fp4 (model.fp4.recipe is not none)
    order: 20                             # optional: position among the selected patches (lowest first)
    swaps:
      - replacement: megatron_bitdet.kernels.moe_aux:switch_load_balancing_loss_func
        targets: [megatron.core.transformer.moe.moe_utils:switch_load_balancing_loss_func, ...]
        optional_binding: false           # optional: megatron binds the targets only when a GPU package imports
        megatron_core: ">=0.18"           # optional: the versions this swap applies to (else every supported one)
        untouched: {module:attr: reason}  # optional: other bindings of the original, left alone on purpose
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from megatron_bitdet.compat.versions import MEGATRON_CORE
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.resources import shipped_dir

_SYMBOL = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")
_TOP_KEYS = {"id", "rule", "megatron_core", "why", "swaps", "needed_when", "order"}
_OPTIONAL_KEYS = {"megatron_core", "needed_when", "order"}
_SWAP_KEYS = {"replacement", "targets", "optional_binding", "untouched", "megatron_core"}
_NEED_KEYS = {"spec": str, "layers": str, "deterministic": bool, "expert_impl": str, "fp8": bool, "fp4": bool}


def split_symbol(symbol: str) -> Tuple[str, str]:
    """``"pkg.module:attr"`` -> ``("pkg.module", "attr")`` (``attr`` may be ``Class.attr``)."""
    module, attr = symbol.split(":")
    return module, attr


@dataclass(frozen=True)
class Swap:
    """One replacement and every binding (module global) it is installed into."""

    replacement: str
    targets: Tuple[str, ...]
    optional_binding: bool = False
    untouched: Dict[str, str] = field(default_factory=dict)
    megatron_core: Optional[SpecifierSet] = None  # None: every version the declaration supports

    def applies(self, version: str) -> bool:
        return self.megatron_core is None or self.megatron_core.contains(version, prereleases=True)


@dataclass(frozen=True)
class Need:
    """One ``needed_when`` entry: every key given must match the recipe (None: any)."""

    spec: Optional[str] = None
    layers: Optional[str] = None
    deterministic: Optional[bool] = None
    expert_impl: Optional[str] = None
    fp8: Optional[bool] = None  # model.fp8.recipe is not none
    fp4: Optional[bool] = None  # model.fp4.recipe is not none

    def holds(self, recipe, family: str) -> bool:
        return ((self.spec is None or self.spec == family)
                and (self.layers is None or any(recipe.model.has(s) for s in self.layers))
                and (self.deterministic is None or self.deterministic == bool(recipe.determinism.mode))
                and (self.expert_impl is None or self.expert_impl == recipe.model.moe.expert_impl)
                and (self.fp8 is None or self.fp8 == (recipe.model.fp8.recipe != "none"))
                and (self.fp4 is None or self.fp4 == (recipe.model.fp4.recipe != "none")))


@dataclass(frozen=True)
class PatchDeclaration:
    id: str
    rule: str
    megatron_core: SpecifierSet
    why: str
    swaps: Tuple[Swap, ...]
    source: str
    needed_when: Tuple[Need, ...] = ()
    order: int = 0

    def supports(self, version: str) -> bool:
        return self.megatron_core.contains(version, prereleases=True)

    def needed(self, recipe, family: str) -> bool:
        """Whether the recipe (built with spec ``family``) gets this patch whatever the rules decided."""
        return any(n.holds(recipe, family) for n in self.needed_when)


def _fail(source, message):
    raise BitdetInputError(f"{source}: {message}")


def _symbol(source, where, value):
    if not isinstance(value, str) or not _SYMBOL.match(value):
        _fail(source, f"{where} must be 'dotted.module:attribute', got {value!r}")
    return value


def _swap(source, index, data) -> Swap:
    where = f"swaps[{index}]"
    if not isinstance(data, dict):
        _fail(source, f"{where} must be a mapping")
    unknown = set(data) - _SWAP_KEYS
    if unknown:
        _fail(source, f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_SWAP_KEYS)}")
    targets = data.get("targets")
    if not isinstance(targets, list) or not targets:
        _fail(source, f"{where}.targets must be a non-empty list")
    targets = tuple(_symbol(source, f"{where}.targets", t) for t in targets)
    for t in targets:
        if not t.startswith("megatron.core."):
            _fail(source, f"{where}.targets: {t!r} is not a megatron.core symbol")
    if len(set(targets)) != len(targets):
        _fail(source, f"{where}.targets lists a binding twice")
    optional = data.get("optional_binding", False)
    if not isinstance(optional, bool):
        _fail(source, f"{where}.optional_binding must be true or false")
    untouched = data.get("untouched", {})
    if not isinstance(untouched, dict) or not all(isinstance(v, str) and v.strip() for v in untouched.values()):
        _fail(source, f"{where}.untouched must map 'module:attr' to a reason")
    for key in untouched:
        _symbol(source, f"{where}.untouched", key)
    versions = _specifier(source, f"{where}.megatron_core", data["megatron_core"]) if "megatron_core" in data else None
    return Swap(_symbol(source, f"{where}.replacement", data.get("replacement")), targets, optional, dict(untouched),
                versions)


def _specifier(source, where, value) -> SpecifierSet:
    try:
        if not isinstance(value, str) or not value.strip():
            raise InvalidSpecifier(value)
        return SpecifierSet(value)
    except InvalidSpecifier:
        _fail(source, f"{where}: {value!r} is not a version specifier (e.g. '>=0.16.1,<0.18')")


def _needs(source, data) -> Tuple[Need, ...]:
    if not isinstance(data, list):
        _fail(source, "needed_when must be a list of mappings")
    needs = []
    for i, entry in enumerate(data):
        where = f"needed_when[{i}]"
        if not isinstance(entry, dict) or not entry:
            _fail(source, f"{where} must be a non-empty mapping")
        unknown = set(entry) - set(_NEED_KEYS)
        if unknown:
            _fail(source, f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_NEED_KEYS)}")
        for key, value in entry.items():
            if not isinstance(value, _NEED_KEYS[key]):
                _fail(source, f"{where}.{key} must be a {_NEED_KEYS[key].__name__}, got {value!r}")
        needs.append(Need(**entry))
    return tuple(needs)


def parse_declaration(data, source: str) -> PatchDeclaration:
    """Validate one declaration (already parsed YAML); ``source`` names it in every error."""
    if not isinstance(data, dict):
        _fail(source, "a patch declaration must be a YAML mapping")
    missing, unknown = _TOP_KEYS - _OPTIONAL_KEYS - set(data), set(data) - _TOP_KEYS
    if missing or unknown:
        _fail(source, f"missing key(s) {sorted(missing)}, unknown key(s) {sorted(unknown)}; "
                      f"required: {sorted(_TOP_KEYS - _OPTIONAL_KEYS)}")
    for key in ("id", "rule", "why", *(["megatron_core"] if "megatron_core" in data else [])):
        if not isinstance(data[key], str) or not data[key].strip():
            _fail(source, f"{key} must be a non-empty string")
    spec = _specifier(source, "megatron_core", data["megatron_core"]) if "megatron_core" in data else MEGATRON_CORE
    if not isinstance(data["swaps"], list) or not data["swaps"]:
        _fail(source, "swaps must be a non-empty list")
    swaps = tuple(_swap(source, i, s) for i, s in enumerate(data["swaps"]))
    order = data.get("order", 0)
    if not isinstance(order, int) or isinstance(order, bool):
        _fail(source, f"order must be an integer, got {order!r}")
    return PatchDeclaration(data["id"], data["rule"], spec, data["why"].strip(), swaps, source,
                            _needs(source, data.get("needed_when", [])), order)


def load_declaration(path) -> PatchDeclaration:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise BitdetInputError(f"{path}: cannot read patch declaration: {exc}") from exc
    decl = parse_declaration(data, str(path))
    if decl.id != path.stem:
        _fail(path, f"id {decl.id!r} must equal the file name {path.stem!r}")
    return decl


def load_declarations(directory=None, ids: Optional[List[str]] = None) -> List[PatchDeclaration]:
    """Every ``*.yaml`` in ``directory`` (default: the shipped ``patches/``), sorted by id;
    with ``ids``, exactly those (an unknown id is an error)."""
    directory = Path(directory) if directory is not None else shipped_dir("patches")
    decls = {d.id: d for d in map(load_declaration, sorted(directory.glob("*.yaml")))}
    if ids is None:
        return list(decls.values())
    unknown = [i for i in ids if i not in decls]
    if unknown:
        raise BitdetInputError(f"unknown patch id(s) {unknown} in {directory}; known: {sorted(decls)}")
    return [decls[i] for i in ids]
