"""Layer-spec builders across megatron-core versions: before 0.17 a spec node is ``ModuleSpec(module,
params, submodules)`` and a backend provider's ``grouped_mlp_modules(moe_use_grouped_gemm,
moe_use_legacy_grouped_gemm)`` returns ``(module, submodules)``; from 0.17 nodes may be
``functools.partial(module, submodules=..., **params)`` (what its layer specs hold) and the provider takes
one argument and returns such a partial. The legacy ``GroupedMLP`` (what megatron's TE specs build for
grouped experts when TE does not import) is gone from 0.17. Whoever edits a spec reads and rebuilds a node
through here, in the node's own shape."""
from __future__ import annotations

import dataclasses
import functools

from packaging.specifiers import SpecifierSet

from megatron_bitdet.compat.versions import megatron_core_version, supports

PARTIAL_BUILDERS = SpecifierSet(">=0.17")


def partial_builders() -> bool:
    """The installed megatron-core builds its layer specs with ``partial`` builders (and has no legacy
    ``GroupedMLP``)."""
    return supports(megatron_core_version(), PARTIAL_BUILDERS)


def is_builder(node) -> bool:
    from megatron.core.transformer.spec_utils import ModuleSpec

    return isinstance(node, (ModuleSpec, functools.partial))


def module_of(node):
    """What a ``ModuleSpec`` or ``partial`` builder calls."""
    return node.func if isinstance(node, functools.partial) else node.module


def submodules_of(node):
    """The submodules a ``ModuleSpec`` or ``partial`` builder passes (None if it passes none)."""
    return node.keywords.get("submodules") if isinstance(node, functools.partial) else node.submodules


def params_of(node) -> dict:
    """The other keywords a builder passes: a ModuleSpec's ``params``, a partial's keywords but
    ``submodules``."""
    if isinstance(node, functools.partial):
        return {k: v for k, v in node.keywords.items() if k != "submodules"}
    return dict(node.params)


_KEEP = object()


def rebuilt(node, *, module=None, submodules=_KEEP, **params):
    """A new builder of ``node``'s shape: ``module`` built instead, ``submodules`` passed instead, ``params``
    added to (or replacing) what it passes; the original is untouched."""
    if isinstance(node, functools.partial):
        keywords = {**node.keywords, **params}
        if submodules is not _KEEP:
            keywords["submodules"] = submodules
        return functools.partial(module or node.func, *node.args, **keywords)
    return dataclasses.replace(node, module=module or node.module, params={**node.params, **params},
                               submodules=node.submodules if submodules is _KEEP else submodules)


def with_module(builder, module):
    """``builder`` (a provider's experts builder, either shape) building ``module`` instead, with the same
    submodules and params."""
    if isinstance(builder, functools.partial):
        return rebuilt(builder, module=module)
    return module, builder[1]
