"""YAML → plain dict with a source location per key path; ``extends:`` merging; ``key.path=value`` overrides.

Locations come from SafeLoader's composed node tree (marks), so loading stays safe_load-equivalent.
"""
from __future__ import annotations

import os
import re

import yaml

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.recipe.typed import Issue, Path, format_path

Locations = dict  # Path -> (source, line or None)


class RecipeError(BitdetInputError):
    """All schema issues of one recipe, each as 'source:line: key.path: message'."""

    def __init__(self, lines):
        self.lines = list(lines)
        super().__init__(f"{len(self.lines)} recipe error(s):\n" + "\n".join(f"  {l}" for l in self.lines))


def locate(path: Path, locations: Locations, default_source: str) -> str:
    """'file:line' of a key path, or of its nearest located ancestor."""
    while path and path not in locations:
        path = path[:-1]
    source, line = locations.get(path, (default_source, None))
    return f"{source}:{line}" if line else source


def render(issue: Issue, locations: Locations, default_source: str) -> str:
    """'file:line: key.path: message'."""
    where = locate(issue.path, locations, default_source)
    key = format_path(issue.path)
    return f"{where}: {key}: {issue.message}" if key else f"{where}: {issue.message}"


def _walk(node, path: Path, source: str, locs: Locations, issues: list, walked: set):
    """Key locations and key errors, each node once: an alias is the node it names, so a file of nested
    aliases (a "billion laughs") is walked in the time it was composed, not once per expansion."""
    if id(node) in walked:
        return
    walked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str) or key_node.tag != "tag:yaml.org,2002:str":
                locs[path] = (source, key_node.start_mark.line + 1)
                issues.append(Issue(path, f"keys must be strings, got {key_node.value!r}"))
                continue
            locs[path + (key,)] = (source, key_node.start_mark.line + 1)
            if key in seen:
                issues.append(Issue(path + (key,), "duplicate key"))
            seen.add(key)
            _walk(value_node, path + (key,), source, locs, issues, walked)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            locs[path + (i,)] = (source, item.start_mark.line + 1)
            _walk(item, path + (i,), source, locs, issues, walked)


def read_yaml(path: str):
    """(data, locations) of one YAML file; syntax or key errors raise RecipeError naming file:line."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise BitdetInputError(f"{path}: cannot read recipe: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise RecipeError([f"{path}:{line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                           "a recipe is a UTF-8 YAML file"]) from None
    try:
        loader = yaml.SafeLoader(text)  # checks every character is printable: may raise already
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise RecipeError([f"{path}:{line}: invalid YAML: character #x{exc.character:04x} is not allowed"]) from None
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise RecipeError([f"{path}{line}: invalid YAML: {exc.problem or exc.context}"]) from None
    except yaml.YAMLError as exc:
        raise RecipeError([f"{path}: invalid YAML: {exc}"]) from None
    except (ValueError, RecursionError) as exc:  # an over-long integer, nesting deeper than Python's stack
        raise RecipeError([f"{path}: invalid YAML: {str(exc)[:200]}"]) from None
    finally:
        loader.dispose()
    locs, issues = {(): (path, 1)}, []
    _walk(node, (), path, locs, issues, set())
    if not isinstance(data, dict):
        issues.append(Issue((), f"a recipe must be a mapping of sections, got {type(data).__name__}"))
    if issues:
        raise RecipeError([render(i, locs, path) for i in issues])
    return data, locs


def deep_merge(base: dict, child: dict) -> dict:
    """Child over base; mappings merge key by key, anything else (lists too) replaces."""
    out = dict(base)
    for key, value in child.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def resolve_file(path: str, _chain=()):
    """Load ``path`` and everything it ``extends:`` (relative to the file); returns (data, locations)."""
    real = os.path.realpath(path)
    if real in _chain:
        raise RecipeError([f"{path}: extends: cycle through {' -> '.join(_chain + (real,))}"])
    data, locs = read_yaml(path)
    parent = data.pop("extends", None)
    if parent is None:
        return data, locs
    if not isinstance(parent, str) or not parent:
        raise RecipeError([render(Issue(("extends",), f"expected a file path, got {parent!r}"), locs, path)])
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), parent))
    if not os.path.isfile(base_path):
        raise RecipeError([render(Issue(("extends",), f"base recipe {base_path} does not exist"), locs, path)])
    base, base_locs = resolve_file(base_path, _chain + (real,))
    return deep_merge(base, data), {**base_locs, **locs}


_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _locate_all(value, path: Path, source: str, locs: Locations):
    locs[path] = (source, None)
    if isinstance(value, dict):
        for k, v in value.items():
            _locate_all(v, path + (k,), source, locs)


def apply_overrides(data: dict, locs: Locations, overrides) -> list:
    """Set each 'a.b.c=value' (value parsed as a YAML scalar / flow collection); returns the issues."""
    issues = []
    for text in overrides:
        source = f"<override {text if len(text) <= 80 else text[:77] + '...'!r}>"
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not _KEY.match(key):
            issues.append(f"{source}: expected key.path=value (e.g. model.hidden_size=128)")
            continue
        path = tuple(key.split("."))
        if path[0] == "extends":
            issues.append(f"{source}: extends: cannot be overridden; edit the recipe file")
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            issues.append(f"{source}: {key}: value is not valid YAML: {getattr(exc, 'problem', exc)}")
            continue
        except (ValueError, RecursionError) as exc:  # an over-long integer, nesting deeper than Python's stack
            issues.append(f"{source}: {key}: value is not usable YAML: {str(exc)[:120]}")
            continue
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if child is None:  # `section:` left empty in YAML
                child = node[part] = {}
            if not isinstance(child, dict):
                issues.append(f"{source}: {'.'.join(path[:i + 1])} is {child!r}, not a mapping")
                break
            if path[: i + 1] not in locs:
                locs[path[: i + 1]] = (source, None)
            node = child
        else:
            node[path[-1]] = value
            _locate_all(value, path, source, locs)
    return issues
