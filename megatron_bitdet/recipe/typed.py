"""Build frozen dataclasses from plain YAML data, collecting every schema issue instead of stopping at one.

Types come from the annotations (bool/int/float/str, Optional, Literal, tuple[X, ...], dict[str, str],
nested dataclasses); ranges from ``bounded(...)`` field metadata; derived checks from an optional
``_checks(self)`` method yielding ``(relative key path, message)``.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field

Path = tuple  # of str keys and int list indices


@dataclass(frozen=True)
class Issue:
    path: Path
    message: str


def bounded(default=dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None):
    """A dataclass field with a numeric range the builder enforces (no default = a required key)."""
    return field(default=default, metadata={"ge": ge, "gt": gt, "le": le, "lt": lt})


def checked(check, default=dataclasses.MISSING):
    """A field whose value ``check(value)`` vets on its own (returns a message or None), so the issue is
    reported even when sibling fields are broken and the section's derived checks cannot run."""
    return field(default=default, metadata={"check": check})


def format_path(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin is typing.Union:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping of strings"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


_MISSING = object()


def _convert(tp, value, path: Path, issues: list):
    """Return the typed value, or _MISSING after recording why it does not fit."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, issues)
    if origin is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path, issues)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        issues.append(Issue(path, f"{value!r} is not allowed; allowed: {', '.join(map(str, choices))}{hint}"))
        return _MISSING
    if origin in (tuple, list):
        if not isinstance(value, list):
            issues.append(Issue(path, f"expected {_type_name(tp)}, got {value!r}"))
            return _MISSING
        items = [_convert(typing.get_args(tp)[0], v, path + (i,), issues) for i, v in enumerate(value)]
        return _MISSING if _MISSING in items else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            issues.append(Issue(path, f"expected {_type_name(tp)}, got {value!r}"))
            return _MISSING
        out = {}
        for k, v in value.items():
            # YAML reads `VAR: 0` as an int; environment values are strings, so accept plain scalars.
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                issues.append(Issue(path + (k,), f"expected a string value, got {v!r}"))
            else:
                out[str(k)] = str(v)
        return out
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[tp]
    if not ok:
        issues.append(Issue(path, f"expected {_type_name(tp)}, got {value!r}"))
        return _MISSING
    return float(value) if tp is float else value


def _check_range(meta, value, path, issues) -> bool:
    for key, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                          ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<")):
        bound = meta.get(key)
        if bound is not None and value is not None and not ok(value, bound):
            issues.append(Issue(path, f"{value!r} is out of range: must be {word} {bound}"))
            return False
    return True


def build(cls, data, path: Path, issues: list):
    """Instantiate dataclass ``cls`` from ``data``; on any issue record it and return _MISSING."""
    if not isinstance(data, dict):
        issues.append(Issue(path, f"expected a mapping, got {data!r}"))
        return _MISSING
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    start = len(issues)
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else f"; allowed: {', '.join(fields)}"
            issues.append(Issue(path + (key,), f"unknown key{hint}"))
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                issues.append(Issue(path + (name,), f"missing required key ({_type_name(hints[name])})"))
            continue
        value = _convert(hints[name], data[name], path + (name,), issues)
        if value is _MISSING or not _check_range(f.metadata, value, path + (name,), issues):
            continue
        message = f.metadata.get("check", lambda v: None)(value)
        if message:
            issues.append(Issue(path + (name,), message))
        else:
            kwargs[name] = value
    if len(issues) > start:
        return _MISSING
    obj = cls(**kwargs)
    for rel, message in getattr(obj, "_checks", lambda: ())():
        issues.append(Issue(path + tuple(rel.split(".")), message))
    return obj if len(issues) == start else _MISSING


def is_missing(obj) -> bool:
    return obj is _MISSING


def to_plain(obj):
    """Dataclass → JSON-ready dict (tuples become lists) with the YAML key names."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
