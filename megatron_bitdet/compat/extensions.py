"""Whether an optional GPU extension is usable here: one answer for every layer that asks (the launch line's
machine rows, ``bitdet train``'s spec family, the FP4/FP8 judgements)."""
from __future__ import annotations

import importlib


def imports(name: str) -> bool:
    """``name`` imports here. CUDA extensions raise OSError / RuntimeError, not only ImportError, without a GPU."""
    try:
        importlib.import_module(name)
    except Exception:
        return False
    return True


def te_here() -> bool:
    """Transformer Engine imports here (its PyTorch part: without CUDA it raises, not only ImportError)."""
    return imports("transformer_engine") and imports("transformer_engine.pytorch")
