"""Layer-spec builders across megatron-core versions: before 0.17 a backend provider's
``grouped_mlp_modules(moe_use_grouped_gemm, moe_use_legacy_grouped_gemm)`` returns ``(module, submodules)``;
from 0.17 it takes one argument and returns ``functools.partial(module, submodules=...)``."""
from __future__ import annotations

import functools


def with_module(builder, module):
    """``builder`` (either shape) building ``module`` instead, with the same submodules and params."""
    if isinstance(builder, functools.partial):
        return functools.partial(module, *builder.args, **builder.keywords)
    return module, builder[1]
