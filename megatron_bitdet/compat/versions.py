"""The megatron-core versions bitdet supports: one specifier, read by every version check.

pyproject's dependency range, the start-up refusal (:func:`require_supported`), the CPU seams and the
patch declarations (unless a declaration or one of its swaps narrows it with its own ``megatron_core``)
all mean this specifier; ``docs/COMPAT.md`` lists what differs inside it and every site to re-check
when it changes (a test holds the document, the range and this line to each other). The range's lower
bound keeps pip from ever downgrading a user's megatron-core inside it.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet

from megatron_bitdet.errors import BitdetError, BitdetInputError

MEGATRON_CORE = SpecifierSet(">=0.16.1,<0.20")


def describe(spec: SpecifierSet = MEGATRON_CORE) -> str:
    """'0.16.1' for an exact pin, else the specifier, lowest bound first (for messages)."""
    text = str(spec)
    if text.startswith("==") and "," not in text:
        return text[2:]
    return ",".join(sorted(text.split(","), key=lambda s: not s.startswith(">")))


def supports(found: str, spec: SpecifierSet = MEGATRON_CORE) -> bool:
    return spec.contains(found, prereleases=True)


def megatron_core_version() -> str:
    try:
        return version("megatron-core")
    except PackageNotFoundError as exc:
        raise BitdetError("megatron-core is not installed") from exc


def require_supported() -> str:
    """The installed megatron-core version; refuses (exit 2) one outside the range, naming both."""
    found = megatron_core_version()
    if not supports(found):
        raise BitdetInputError(
            f"megatron-core {found} is installed; megatron-bitdet supports megatron-core {describe()} "
            f"(pip install 'megatron-core{describe()}')")
    return found
