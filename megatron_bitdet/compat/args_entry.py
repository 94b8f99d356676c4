"""Where Megatron-LM's training takes the launch line, across versions: the call that receives the script's
``extra_args_provider`` and ``args_defaults`` before anything initializes, and the ``validate_args`` binding
that call reaches.

Before 0.18 the script passes both to ``training.pretrain``, whose ``initialize_megatron`` parses and calls
``initialize.validate_args`` (its ``from megatron.training.arguments import validate_args`` copy). From 0.18
the script's ``__main__`` calls ``arguments.parse_and_validate_args(extra_args_provider=..., args_defaults=...)``
itself (imported by name when the script is imported, after these seams are replaced), which calls
``arguments.validate_args``; ``pretrain`` then takes a config container built from the validated args.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet

from megatron_bitdet.compat.versions import megatron_core_version, supports


@dataclass(frozen=True)
class Seam:
    """A function Megatron-LM's callers read as the global ``name`` of each module in ``holders``."""

    name: str
    holders: tuple[str, ...]

    def original(self):
        return getattr(importlib.import_module(self.holders[0]), self.name)

    def replace(self, fn) -> None:
        for holder in self.holders:
            setattr(importlib.import_module(holder), self.name, fn)


def _from_0_18() -> bool:
    return supports(megatron_core_version(), SpecifierSet(">=0.18"))


def line_entry() -> Seam:
    """The call taking ``extra_args_provider=`` / ``args_defaults=`` keywords before initialization."""
    if _from_0_18():
        return Seam("parse_and_validate_args", ("megatron.training.arguments",))
    return Seam("pretrain", ("megatron.training.training", "megatron.training"))


def validate_args() -> Seam:
    """The ``validate_args`` binding the line entry's parse calls."""
    holder = "megatron.training.arguments" if _from_0_18() else "megatron.training.initialize"
    return Seam("validate_args", (holder,))
