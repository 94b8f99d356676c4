"""The import layers written in docs/DESIGN.md hold for every import of the package (read from the source)."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from megatron_bitdet.resources import KINDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_bitdet"
OUTSIDE = {"megatron_bitdet", "megatron_bitdet.__main__"}  # the root facade and the entry point


def _layers() -> dict[str, int]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("## Import layers", 1)[1].split("\n## ", 1)[0]
    return {name.strip(): int(level) for level, names in re.findall(r"^(\d+)\. (.+)$", section, re.M)
            for name in names.split(",")}


def _modules() -> dict[str, Path]:
    """Every module of the package (shipped data folders, installed as packages too, are not code)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if len(parts) > 1 and parts[1] in KINDS:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    parts = module.split(".")
    return module if len(parts) == 1 else parts[1]


def _imports(path: Path):
    """(imported module, imported names) for every import statement, function-level ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("megatron_bitdet"):
                    yield a.name, []
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("megatron_bitdet"):
            names = [a.name for a in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
            rest = [n for n in names if f"{node.module}.{n}" not in MODULES]
            if rest or not submodules:
                yield node.module, rest
            for sub in submodules:
                yield sub, []


@functools.cache
def _edges() -> tuple:
    return tuple((module, target, names) for module, path in MODULES.items() for target, names in _imports(path))


def test_every_package_is_placed_in_a_layer():
    layers = _layers()
    packages = {_package(m) for m in MODULES if m not in OUTSIDE}
    assert packages - set(layers) == set(), "docs/DESIGN.md 'Import layers' does not place these packages"
    assert set(layers) - packages == set(), "docs/DESIGN.md 'Import layers' names packages that do not exist"


def test_imports_only_go_down_the_layers():
    layers = _layers()
    bad = []
    for module, target, names in _edges():
        if module in OUTSIDE or target in OUTSIDE and names == ["__version__"]:
            continue
        src, dst = _package(module), _package(target)
        if src != dst and not layers[dst] < layers[src]:
            bad.append(f"{module} imports {target} (layer {layers[dst]} {dst} from layer {layers[src]} {src})")
    assert not bad, "\n".join(bad)


def test_no_private_name_crosses_a_package():
    bad = [f"{module} imports {target}:{n}" for module, target, names in _edges()
           for n in names if n.startswith("_") and not n.startswith("__") and _package(module) != _package(target)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph: dict[str, set] = {m: set() for m in MODULES}
    for module, target, _ in _edges():
        if module not in OUTSIDE and target in MODULES and target not in OUTSIDE and target != module:
            graph[module].add(target)
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)
