"""YAML recipes: strict schema with file:line errors, ``extends:``, ``key.path=value`` overrides, digest."""
from __future__ import annotations

import hashlib
import json

from megatron_bitdet.recipe.loader import RecipeError, apply_overrides, locate, render, resolve_file
from megatron_bitdet.recipe.schema import PATTERN_SYMBOLS, RecipeConfig
from megatron_bitdet.recipe.typed import build, is_missing, to_plain
from megatron_bitdet.resources import resolve_recipe

__all__ = ["Recipe", "RecipeError", "load_recipe", "PATTERN_SYMBOLS"]


class Recipe(RecipeConfig):
    """A validated, resolved recipe. Sections are attributes named like the YAML keys."""

    @classmethod
    def from_dict(cls, data, *, source: str = "<dict>", locations=None) -> "Recipe":
        """Validate a plain dict (e.g. a manifest's ``recipe``); every issue is reported at once."""
        locations = dict(locations or {})
        issues = []
        recipe = build(cls, data, (), issues)
        if issues or is_missing(recipe):
            raise RecipeError([render(i, locations, source) for i in issues])
        object.__setattr__(recipe, "source", source)
        object.__setattr__(recipe, "_locations", locations)
        return recipe

    def where(self, *path) -> str:
        """'file:line' where a key path was set (nearest located ancestor), for later diagnostics."""
        return locate(tuple(path), self._locations, self.source)

    def to_dict(self) -> dict:
        return to_plain(self)

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    def digest(self) -> str:
        """sha256 of the canonical JSON of the resolved recipe (overrides and extends applied)."""
        return "sha256:" + hashlib.sha256(self.canonical_json().encode()).hexdigest()


def load_recipe(path: str, overrides=()) -> Recipe:
    """Load (a file path or a shipped recipe's name), merge ``extends:``, apply overrides, validate.
    Raises RecipeError listing every issue."""
    path = resolve_recipe(path)
    data, locations = resolve_file(path)
    override_issues = apply_overrides(data, locations, overrides)
    try:
        recipe = Recipe.from_dict(data, source=str(path), locations=locations)
    except RecipeError as exc:
        raise RecipeError(override_issues + exc.lines) from None
    if override_issues:
        raise RecipeError(override_issues)
    return recipe
