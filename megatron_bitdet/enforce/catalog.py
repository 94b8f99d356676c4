"""The catalog of known nondeterminism sources (``catalog/known_sources.yaml``, shipped as package data
``megatron_bitdet.catalog``): loading and validation. The data file owns the knowledge; this module
only reads and checks it."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.resources import shipped_dir

CATALOG_FILE = "known_sources.yaml"
SYMPTOM_FIELDS = {
    "first_step": str, "metrics": list, "lm_loss_equal": bool, "scope_keys": list, "resume_components": list,
    "classification": list, "read_artifact": list, "ops": list, "modules": list, "kernel_mechanism": list,
    "deterministic_variant": list,
}
FIRST_STEPS = ("start", "after_restore", "later")
ENTRY_KEYS = ("id", "title", "mechanism", "symptom", "fix", "rules", "next", "references", "implementations")
CHANGE_KEYS = ("key", "env", "value", "kind", "what")
FIX_KINDS = ("corrects", "works_around")


@dataclass(frozen=True)
class Entry:
    id: str
    title: str
    mechanism: str
    symptom: dict
    fix: dict
    rules: tuple
    next: str
    references: tuple
    implementations: tuple = ()  # 'module:attr' classes / functions that are this source (enforce.audit)


@dataclass(frozen=True)
class FixChange:
    """One row of ``fix_changes``: a recipe key (optionally with a value) or an env variable."""

    kind: str
    what: str
    key: str | None = None
    env: str | None = None
    value: object = field(default=None)
    has_value: bool = False


@dataclass(frozen=True)
class Catalog:
    entries: tuple
    fix_changes: tuple
    source: str

    def get(self, entry_id: str) -> Entry:
        for e in self.entries:
            if e.id == entry_id:
                return e
        raise KeyError(entry_id)

    def for_rule(self, rule_id: str) -> Entry | None:
        return next((e for e in self.entries if rule_id in e.rules), None)


def _bad(source: str, where: str, why: str) -> BitdetInputError:
    return BitdetInputError(f"{source}: {where}: {why}")


def _known(source: str, where: str, raw: dict, allowed) -> None:
    unknown = [str(k) for k in raw if k not in allowed]
    if unknown:
        raise _bad(source, f"{where}.{unknown[0]}", f"unknown key (known: {', '.join(allowed)})")


def _entry(source: str, i: int, raw) -> Entry:
    where = f"entries[{i}]"
    if not isinstance(raw, dict):
        raise _bad(source, where, "expected a mapping")
    _known(source, where, raw, ENTRY_KEYS)
    for key in ("id", "title", "mechanism", "next"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise _bad(source, f"{where}.{key}", "a non-empty string is required")
    symptom = raw.get("symptom") or {}
    if not isinstance(symptom, dict):
        raise _bad(source, f"{where}.symptom", "expected a mapping")
    for key, value in symptom.items():
        if key not in SYMPTOM_FIELDS:
            raise _bad(source, f"{where}.symptom.{key}", f"unknown field (known: {', '.join(SYMPTOM_FIELDS)})")
        if not isinstance(value, SYMPTOM_FIELDS[key]) or (isinstance(value, list) and not all(
                isinstance(v, str) for v in value)):
            raise _bad(source, f"{where}.symptom.{key}", f"expected {SYMPTOM_FIELDS[key].__name__}")
    if "first_step" in symptom and symptom["first_step"] not in FIRST_STEPS:
        raise _bad(source, f"{where}.symptom.first_step", f"expected one of {', '.join(FIRST_STEPS)}")
    fix = raw.get("fix")
    if not isinstance(fix, dict) or fix.get("kind") not in FIX_KINDS or not isinstance(fix.get("change"), str):
        raise _bad(source, f"{where}.fix", f"needs change (string) and kind ({' | '.join(FIX_KINDS)})")
    rules, refs = raw.get("rules") or [], raw.get("references") or []
    if not isinstance(rules, list) or not isinstance(refs, list):
        raise _bad(source, f"{where}.rules/references", "expected lists")
    impls = raw.get("implementations") or []
    if not isinstance(impls, list) or not all(isinstance(i, str) and i.count(":") == 1 for i in impls):
        raise _bad(source, f"{where}.implementations", "expected a list of 'module:attr' strings")
    return Entry(raw["id"], raw["title"], raw["mechanism"].strip(), symptom, fix, tuple(rules), raw["next"],
                 tuple(map(str, refs)), tuple(impls))


def _fix_change(source: str, i: int, raw) -> FixChange:
    where = f"fix_changes[{i}]"
    if not isinstance(raw, dict) or raw.get("kind") not in FIX_KINDS or not isinstance(raw.get("what"), str):
        raise _bad(source, where, f"needs kind ({' | '.join(FIX_KINDS)}) and what")
    _known(source, where, raw, CHANGE_KEYS)
    if bool(raw.get("key")) == bool(raw.get("env")):
        raise _bad(source, where, "needs exactly one of key, env")
    return FixChange(raw["kind"], raw["what"], raw.get("key"), raw.get("env"), raw.get("value"), "value" in raw)


def load_catalog(path=None) -> Catalog:
    """The shipped catalog (or ``path``), validated; BitdetInputError names the file and key."""
    path = Path(path) if path is not None else shipped_dir("catalog") / CATALOG_FILE
    source = str(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise BitdetInputError(f"{source}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise BitdetInputError(f"{source}{line}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    except ValueError as exc:  # undecodable bytes
        raise BitdetInputError(f"{source}: not a text file ({exc})") from None
    if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("entries"), list):
        raise BitdetInputError(f"{source}: not a bitdet catalog (version: 1 and an entries list expected)")
    entries = tuple(_entry(source, i, e) for i, e in enumerate(data["entries"]))
    ids = [e.id for e in entries]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise _bad(source, "entries", f"duplicate id(s) {', '.join(dup)}")
    changes = tuple(_fix_change(source, i, c) for i, c in enumerate(data.get("fix_changes") or []))
    return Catalog(entries, changes, source)
