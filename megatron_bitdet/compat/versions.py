"""The megatron-core versions bitdet supports: one specifier, read by every version check.

The CPU seams, the patch declarations (unless one narrows it with its own ``megatron_core``) and
pyproject's dependency pin all mean this specifier; ``docs/COMPAT.md`` lists every site to re-check
when it changes (a test holds the document, the pin and this line to each other).
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet

from megatron_bitdet.errors import BitdetError

MEGATRON_CORE = SpecifierSet("==0.16.1")


def describe(spec: SpecifierSet = MEGATRON_CORE) -> str:
    """'0.16.1' for an exact pin, else the specifier itself (for messages)."""
    text = str(spec)
    return text[2:] if text.startswith("==") and "," not in text else text


def supports(found: str, spec: SpecifierSet = MEGATRON_CORE) -> bool:
    return spec.contains(found, prereleases=True)


def megatron_core_version() -> str:
    try:
        return version("megatron-core")
    except PackageNotFoundError as exc:
        raise BitdetError("megatron-core is not installed") from exc
