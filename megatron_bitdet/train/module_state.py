"""State a model holds across steps besides its parameters: every ``torch.Generator`` reachable from a
module's attributes (a custom dropout drawing from its own generator) and every buffer (the router's
``expert_bias``, updated each step). Found by walking the modules, not from a list, so a checkpoint
carries it, a restore sets it, snapshots compare it and the per-step digests cover it.
"""
from __future__ import annotations

import torch

from megatron_bitdet.errors import BitdetInputError


_NEITHER, _GENERATOR, _CONTAINER = 0, 1, 2
_KINDS: dict[type, int] = {}
_NEITHER_TYPES: set[type] = set()  # the types _kind found to be neither
# what nn.Module.__init__ sets: parameters, buffers, submodules (each type-checked when registered),
# hooks (callables) and flags; a generator a module holds is one of its other attributes
_MODULE_OWN = frozenset(vars(torch.nn.Module()))


def _kind(value) -> int:
    """Whether a value is a generator, a list/tuple/dict to look into, or neither; cached per type:
    the scan runs over every module, and ``isinstance`` against ``torch.Generator`` misses through a
    Python-level metaclass check."""
    t = type(value)
    kind = _KINDS.get(t)
    if kind is None:
        kind = _KINDS[t] = (_GENERATOR if issubclass(t, torch.Generator)
                            else _CONTAINER if issubclass(t, (list, tuple, dict)) else _NEITHER)
        if kind == _NEITHER:
            _NEITHER_TYPES.add(t)
    return kind


def walk(chunks) -> list[tuple[int, str, torch.nn.Module]]:
    """(chunk index, module path, module) for every module, each chunk's ``named_modules()`` in order:
    the one walk the readers of a model's state share (a checkpoint, a snapshot; the per-step digests
    walk only when the model's structure changed: ``step_fingerprints.StepDigests``)."""
    return [(i, name, m) for i, chunk in enumerate(chunks) for name, m in chunk.named_modules()]


def named_members(walked, members: str):
    """(chunk index, qualified name, tensor) as each chunk's ``named_buffers()`` (``members`` "_buffers")
    or ``named_parameters()`` ("_parameters") lists them — None skipped, a tensor reachable twice in a
    chunk named once — read from a walk instead of walking again."""
    for i, name, _, _, t in _members(walked, members):
        yield i, name, t


def _members(walked, members: str):
    """``named_members`` with each tensor's holder: (chunk, qualified name, module, key, tensor)."""
    chunk, seen = None, set()
    for i, name, module in walked:
        if i != chunk:
            chunk, seen = i, set()
        for key, t in getattr(module, members).items():
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            yield i, f"{name}.{key}" if name else key, module, key, t


def _held(container, depth: int = 0):
    """(path suffix, generator) for the generators in a list/tuple/dict attribute, two levels deep;
    a suffix is only formatted for a generator found."""
    is_dict = isinstance(container, dict)
    for key, item in (container.items() if is_dict else enumerate(container)):
        kind = _kind(item)
        if kind == _NEITHER or (kind == _CONTAINER and (depth >= 1 or not item)):
            continue
        label = f"[{key!r}]" if is_dict else f"[{key}]"
        for suffix, gen in (("", item),) if kind == _GENERATOR else _held(item, depth + 1):
            yield label + suffix, gen


def module_generators(modules, walked=None) -> dict[str, torch.Generator]:
    """'<chunk>.<module path>:<attribute>' -> generator, for every generator the model chunks hold
    in an attribute, directly or in a list/tuple/dict (a generator reachable twice is named once, by
    its first path). ``walked``: ``walk(modules)``, when the caller has it."""
    out, seen = {}, set()
    for i, name, module in walk(modules) if walked is None else walked:
        attrs = vars(module)
        # most modules hold nothing but scalars, configs and nn.Module's own state: their attributes'
        # types, all known to be neither, are checked at C speed
        if _NEITHER_TYPES.issuperset(map(type, map(attrs.__getitem__, attrs.keys() - _MODULE_OWN))):
            continue
        for attr, value in attrs.items():
            if attr in _MODULE_OWN:
                continue
            kind = _kind(value)
            if kind == _NEITHER or (kind == _CONTAINER and not value):
                continue
            for suffix, gen in (("", value),) if kind == _GENERATOR else _held(value):
                if id(gen) not in seen:
                    seen.add(id(gen))
                    out[f"{i}.{name or '<root>'}:{attr}{suffix}"] = gen
    return out


def module_buffers(modules, walked=None) -> dict[str, torch.Tensor]:
    """'<chunk>.<buffer name>' -> tensor, persistent and not."""
    return {f"{i}.{name}": b for i, name, b in named_members(walk(modules) if walked is None else walked, "_buffers")}


def module_buffer_sources(walked) -> list[tuple[str, torch.nn.Module, str]]:
    """(name as ``module_buffers`` gives it, holding module, key): where the per-step digests re-read
    each buffer (a module may rebind one) without walking the model again."""
    return [(f"{i}.{name}", m, key) for i, name, m, key, _ in _members(walked, "_buffers")]


def generator_sources(walked) -> list[tuple[str, torch.Generator]]:
    """(name, generator) for every generator the walked modules hold (``module_generators``)."""
    return list(module_generators(None, walked).items())


def capture_module_rng(modules, walked=None) -> dict[str, torch.Tensor]:
    return {where: gen.get_state() for where, gen in module_generators(modules, walked).items()}


def restore_module_rng(modules, saved, *, source) -> None:
    """Set every generator the model holds from ``saved``; a generator the checkpoint does not carry
    (or one it carries that the model lacks) is refused by name, never left at its initial state."""
    live = module_generators(modules)
    saved = saved or {}
    problems = [f"module {w.split(':')[0]} holds torch.Generator '{w.split(':', 1)[1]}', which the checkpoint "
                "does not carry" for w in live if w not in saved]
    problems += [f"the checkpoint carries torch.Generator {w} that the model does not hold" for w in saved
                 if w not in live]
    if problems:
        raise BitdetInputError(f"{source}: {'; '.join(problems)}: a resume would not continue bit for bit")
    for where, gen in live.items():
        gen.set_state(saved[where])
