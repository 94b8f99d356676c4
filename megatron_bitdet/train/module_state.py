"""State a model holds across steps besides its parameters: every ``torch.Generator`` reachable from a
module's attributes (a custom dropout drawing from its own generator) and every buffer (the router's
``expert_bias``, updated each step). Found by walking the modules, not from a list, so a checkpoint
carries it, a restore sets it, snapshots compare it and the per-step digests cover it.
"""
from __future__ import annotations

import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.fingerprint.tensor import state_digest


def _found(value, where: str, depth: int = 0):
    """(path, generator) for generators held directly or in a list/tuple/dict attribute."""
    if isinstance(value, torch.Generator):
        yield where, value
    elif depth < 2 and isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _found(item, f"{where}[{i}]", depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for key, item in value.items():
            yield from _found(item, f"{where}[{key!r}]", depth + 1)


def module_generators(modules) -> dict[str, torch.Generator]:
    """'<chunk>.<module path>:<attribute>' -> generator, for every generator the model chunks hold
    (a generator reachable twice is named once, by its first path)."""
    out, seen = {}, set()
    for i, chunk in enumerate(modules):
        for name, module in chunk.named_modules():
            for attr, value in vars(module).items():
                for where, gen in _found(value, f"{i}.{name or '<root>'}:{attr}"):
                    if id(gen) not in seen:
                        seen.add(id(gen))
                        out[where] = gen
    return out


def module_buffers(modules) -> dict[str, torch.Tensor]:
    """'<chunk>.<buffer name>' -> tensor, persistent and not."""
    return {f"{i}.{name}": b for i, chunk in enumerate(modules) for name, b in chunk.named_buffers()}


def capture_module_rng(modules) -> dict[str, torch.Tensor]:
    return {where: gen.get_state() for where, gen in module_generators(modules).items()}


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


def buffers_digest(modules) -> str:
    return state_digest(module_buffers(modules).items())


def generators_digest(modules) -> str | None:
    """Digest of the generators' states; None when the model holds none."""
    states = capture_module_rng(modules)
    return state_digest(states.items()) if states else None
